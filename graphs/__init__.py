"""LangGraph workflows over one shared, compressed document pool (listed in ``langgraph.json``).

- :mod:`graphs.document_review`: prefetch -> planner -> specialists in parallel -> critic -> summarizer.
- :mod:`graphs.role_swarm`: prefetch -> N roles answer one question in parallel -> aggregator.
- :mod:`graphs.document_agent`: a ReAct-style agent (LangChain's ``create_agent``) with two tools over the pool.

Each module exports ``graph`` (compiled, model not loaded until the first run) and a
``build_graph(...)`` factory for a chat model, pool store or checkpointer of your own. Each file
imports only ``polykv_agents``, LangGraph and LangChain, so ``langgraph dev`` can load it by path.
"""
