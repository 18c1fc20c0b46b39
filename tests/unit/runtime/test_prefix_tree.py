"""The prefix tree on its own: what a match returns, how nodes split, and what the byte budget evicts."""

from __future__ import annotations

import pytest
import torch

from polykv_agents.runtime.prefix_tree import PrefixTrees, common_length

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 4
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # fp32 keys and values


class _Model:
    """Stands in for a model: trees are kept per model object."""


def kv_of(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values ``[KVH, n, D]`` per layer that encode each token and its layer, so a slice from the wrong
    node, layer or offset shows."""
    ids = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
    return [
        (ids.expand(KV_HEADS, -1, HEAD_DIM) + 1000 * layer, -ids.expand(KV_HEADS, -1, HEAD_DIM) - 1000 * layer)
        for layer in range(LAYERS)
    ]


def stored(match, layer: int) -> list[int]:
    keys, values = match.layer(layer)
    assert torch.equal(values, -keys)
    return (keys[0, :, 0] - 1000 * layer).long().tolist()


@pytest.fixture
def trees():
    return PrefixTrees(max_bytes=10**9)


def test_common_length():
    assert common_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_length([1, 2], [1, 2, 3]) == 2
    assert common_length([], [1]) == 0
    assert common_length([9], [1]) == 0


def test_a_match_returns_the_longest_stored_start_within_the_limit(trees):
    tree = trees.tree(_Model(), "pool")
    assert tree.insert([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5])) == 5
    match = tree.match([1, 2, 3, 9], limit=3)
    assert match.length == 3
    assert [stored(match, layer) for layer in range(LAYERS)] == [[1, 2, 3]] * LAYERS
    assert tree.match([1, 2, 3, 4, 5, 6], limit=5).length == 5
    assert tree.match([1, 2, 3, 4, 5, 6], limit=4).length == 4
    assert tree.match([2, 3], limit=2).length == 0
    assert (trees.hits, trees.matched_tokens) == (3, 12)


def test_a_call_that_diverges_inside_a_node_splits_it_and_both_paths_stay_whole(trees):
    tree = trees.tree(_Model(), "pool")
    tree.insert([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5]))
    assert tree.insert([1, 2, 7, 8], kv_of([1, 2, 7, 8])) == 2  # only the two tokens after the split are new
    for path in ([1, 2, 3, 4, 5], [1, 2, 7, 8]):
        match = tree.match([*path, 0], limit=len(path))
        assert match.length == len(path)
        assert stored(match, LAYERS - 1) == path
    assert tree.insert([1, 2, 3], kv_of([1, 2, 3])) == 0  # already stored: nothing new (a split at 3)
    assert sorted(leaf.tokens for leaf in tree.leaves()) == [(4, 5), (7, 8)]
    assert tree.nbytes == 7 * BYTES_PER_TOKEN  # 1 2 | 3 | 4 5 | 7 8: each token once
    assert stored(tree.match([1, 2, 3, 4, 5, 0], limit=5), 1) == [1, 2, 3, 4, 5]


def test_stored_tensors_are_copies_not_views_of_the_callers_cache(trees):
    tree = trees.tree(_Model(), "pool")
    layers = kv_of([1, 2, 3])
    tree.insert([1, 2, 3], layers)
    for keys, values in layers:
        keys.zero_()
        values.zero_()
    assert stored(tree.match([1, 2, 3, 4], limit=3), 0) == [1, 2, 3]


def test_the_budget_evicts_least_recently_used_leaves_and_a_later_call_reports_what_it_lost():
    trees = PrefixTrees(max_bytes=10 * BYTES_PER_TOKEN)
    model = _Model()
    trees.insert(model, "pool", [1, 2, 3, 4], kv_of([1, 2, 3, 4]))
    trees.insert(model, "other pool", [5, 6, 7], kv_of([5, 6, 7]))
    tree, other_pool = trees.tree(model, "pool"), trees.tree(model, "other pool")
    tree.match([1, 2, 3, 4, 0], limit=4)  # [1, 2, 3, 4] is now the most recently used
    tree.insert([8, 9, 10, 11], kv_of([8, 9, 10, 11]))  # 11 tokens: one leaf must go, the other pool's
    assert trees.evictions == 1
    assert (tree.nbytes, other_pool.nbytes) == (8 * BYTES_PER_TOKEN, 0)
    assert trees.nbytes <= trees.max_bytes
    lost = other_pool.match([5, 6, 7, 8], limit=3)
    assert (lost.length, lost.evicted_tokens) == (0, 3)
    kept = tree.match([1, 2, 3, 4, 0], limit=4)
    assert (kept.length, kept.evicted_tokens) == (4, 0)
    # The emptied tree is dropped (a server reading many pools keeps only the recent ones' trees); what it lost is
    # still reported to its pool's next call.
    again = trees.tree(model, "other pool")
    assert again is not other_pool and again.match([5, 6, 7, 8], limit=3).evicted_tokens == 3
    assert trees.tree(model, "pool") is tree


def test_a_tree_per_model_and_pool():
    trees = PrefixTrees(max_bytes=10**9)
    first, second = _Model(), _Model()
    assert trees.tree(first, "pool") is trees.tree(first, "pool")
    assert trees.tree(first, "pool") is not trees.tree(first, "other pool")
    assert trees.tree(first, "pool") is not trees.tree(second, "pool")


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="non-negative number of bytes"):
        PrefixTrees(max_bytes=-1)
