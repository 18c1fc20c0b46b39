"""How closely pooled answers agree with full-precision answers to the same question.

- exact match and token F1 after SQuAD-style normalisation (lower case, no punctuation, no
  articles, collapsed whitespace);
- semantic similarity: cosine of all-MiniLM-L6-v2 sentence embeddings (see :mod:`.embeddings`).
  The paper used BERTScore, which needs a roberta-large download that is not possible offline; this
  is a different metric and is named as such.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalized_tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def exact_match(prediction: str, reference: str) -> bool:
    return normalized_tokens(prediction) == normalized_tokens(reference)


def token_f1(prediction: str, reference: str) -> float:
    """Harmonic mean of token precision and recall (1.0 when both are empty)."""
    predicted, expected = normalized_tokens(prediction), normalized_tokens(reference)
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)
