"""Quality evaluation: the paper's perplexity protocol, on real text available offline."""

from __future__ import annotations

from polykv_agents.eval.corpus import pydoc_documents
from polykv_agents.eval.perplexity import PerplexityResult, perplexity_deltas

__all__ = ["PerplexityResult", "perplexity_deltas", "pydoc_documents"]
