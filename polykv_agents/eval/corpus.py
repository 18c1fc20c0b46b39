"""Real English prose that is present on every machine: CPython's ``pydoc_data.topics``.

The topics (the language reference's prose, about 465,000 characters) are joined in sorted order
and cut into disjoint documents at paragraph boundaries, so the same call always returns the
same documents.
"""

from __future__ import annotations


def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def pydoc_documents(count: int, chars_per_document: int = 40_000) -> list[str]:
    """``count`` disjoint documents of about ``chars_per_document`` characters each.

    Raises:
        ValueError: The corpus is too small for ``count`` documents of that size.
    """
    corpus = _corpus()
    documents: list[str] = []
    start = 0
    for _ in range(count):
        end = corpus.find("\n\n", start + chars_per_document)
        if end < 0:
            msg = (
                f"pydoc_data.topics has {len(corpus)} characters: not enough for {count} documents of "
                f"{chars_per_document} characters; ask for fewer or shorter documents"
            )
            raise ValueError(msg)
        documents.append(corpus[start:end])
        start = end + 2
    return documents
