"""LangGraph's side: the prefetch node that builds a run's pool once, the agent middleware that binds a
loop to it, and the role lists and checks the workflows in ``graphs/`` share."""
