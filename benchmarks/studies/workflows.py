"""The repository's workflows, as its studies load them: :mod:`polykv_agents.graph.langgraph_config`."""

from polykv_agents.graph.langgraph_config import LANGGRAPH_JSON, load_workflow

__all__ = ["LANGGRAPH_JSON", "load_workflow"]
