"""Exact reuse of what earlier calls over a pool already ran through the model: a radix tree of their
tokens' keys and values (SGLang's RadixAttention, on top of the pool).

The pool holds the document's ``T`` tokens. What a call adds after them (its role prompt, a conversation so
far, a ReAct loop's history, and the answer it generated) is stored when the call ends, keyed by its token
ids. A later call over the same pool whose tokens begin with stored ones copies their keys and values into
its own suffix row and prefills only the rest. This is exact, not an approximation: a causal model's keys
and values at position ``i`` depend only on the tokens up to ``i``, and a stored token sits at the same
position, ``T + i``, in every call over the pool.

  root
   |-- node: tokens t[0:a]    keys, values per layer [KVH, a, D]
   |     |-- node: t[a:b]     [KVH, b - a, D]
   |     `-- node: u[a:c]     (another call, which diverged from t after a tokens)

Nodes are kept decoded, in the model's dtype. :class:`PrefixTrees` holds one tree per (model, pool) under
one byte budget; beyond it the least recently used leaves are evicted (a node whose children are all gone
becomes a leaf in turn). An eviction never makes a call wrong: the call prefills what is no longer stored,
and :meth:`PrefixTree.match` says how many of its tokens an eviction cost it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values, each ``[KVH, n, D]``."""

EVICTED_PATHS_KEPT = 64
"""Evicted token paths remembered (the latest, over all trees), so a call that would have read one can report the
tokens it prefilled again (:attr:`PrefixMatch.evicted_tokens`)."""


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _copied(layers: Sequence[LayerKV], start: int, end: int | None) -> tuple[LayerKV, ...]:
    """Tokens ``start:end`` of every layer, copied: a stored node never keeps a larger tensor alive."""
    return tuple((k[:, start:end].clone(), v[:, start:end].clone()) for k, v in layers)


class _Node:
    """A run of tokens that every call through this node shares, with their keys and values."""

    __slots__ = ("children", "last_used", "layers", "parent", "tokens")

    def __init__(self, tokens: tuple[int, ...], layers: tuple[LayerKV, ...], parent: _Node | None) -> None:
        self.tokens = tokens
        self.layers = layers  # per layer (keys, values) [KVH, len(tokens), D]
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token of the child's run -> child
        self.last_used = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def path(self) -> tuple[int, ...]:
        """Every token from the root to the end of this node."""
        runs, node = [], self
        while node is not None:
            runs.append(node.tokens)
            node = node.parent
        return tuple(itertools.chain.from_iterable(reversed(runs)))


@dataclass
class PrefixMatch:
    """The stored part of a call's tokens: its first ``length`` tokens, held by ``segments``."""

    length: int = 0
    segments: list[tuple[_Node, int]] = field(default_factory=list)
    """``(node, tokens used from its start)`` along the path, in order; their counts add up to ``length``."""
    evicted_tokens: int = 0
    """Tokens past ``length`` that were stored for this call's prefix once and have been evicted since."""

    def layer(self, layer_idx: int, length: int | None = None) -> LayerKV:
        """Keys and values ``[KVH, length, D]`` of the first ``length`` (default: all) matched tokens."""
        wanted = self.length if length is None else length
        keys, values, taken = [], [], 0
        for node, count in self.segments:
            count = min(count, wanted - taken)
            if count <= 0:
                break
            k, v = node.layers[layer_idx]
            keys.append(k[:, :count])
            values.append(v[:, :count])
            taken += count
        if len(keys) == 1:  # one node: its slice, not a copy (the caller copies it into its row anyway)
            return keys[0], values[0]
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)


class PrefixTree:
    """One pool's stored suffixes on one model. Made by :meth:`PrefixTrees.tree`, which owns its budget."""

    def __init__(self, owner: PrefixTrees, key: tuple[int, str]) -> None:
        self._owner = owner
        self.key = key
        """``(id of the model, pool digest)``: what evicted paths are remembered under, past this tree's life."""
        self._root = _Node((), (), None)
        self.nbytes = 0
        """Bytes of the keys and values stored."""

    def match(self, tokens: Sequence[int], limit: int) -> PrefixMatch:
        """The longest stored prefix of ``tokens[:limit]``, marked as just used."""
        with self._owner.lock:
            tick = self._owner.tick()
            result, node = PrefixMatch(), self._root
            while result.length < limit:
                child = node.children.get(tokens[result.length])
                if child is None:
                    break
                shared = common_length(child.tokens, tokens[result.length : limit])
                result.segments.append((child, shared))
                result.length += shared
                child.last_used = tick
                if shared < len(child.tokens):
                    break
                node = child
            result.evicted_tokens = self._owner.evicted_past(self, tokens[:limit], result.length)
            if result.length:
                self._owner.hits += 1
                self._owner.matched_tokens += result.length
            return result

    def insert(self, tokens: Sequence[int], layers: Sequence[LayerKV]) -> int:
        """Store ``tokens`` with their keys and values ``layers`` (per layer ``[KVH, len(tokens), D]``, copied,
        never kept as views); returns how many tokens were new. Then evicts down to the budget."""
        with self._owner.lock:
            tick = self._owner.tick()
            node, done = self._root, 0
            while done < len(tokens):
                child = node.children.get(tokens[done])
                if child is None:
                    leaf = _Node(tuple(tokens[done:]), _copied(layers, done, None), node)
                    leaf.last_used = tick
                    node.children[leaf.tokens[0]] = leaf
                    self.nbytes += leaf.nbytes
                    self._owner.evict_over_budget()
                    return len(tokens) - done
                shared = common_length(child.tokens, tokens[done:])
                if shared < len(child.tokens):
                    child = self._split(child, shared)
                child.last_used = tick
                node, done = child, done + shared
            return 0

    @property
    def empty(self) -> bool:
        """Whether nothing is stored."""
        return not self._root.children

    def leaves(self) -> list[_Node]:
        """Nodes without children (the eviction candidates)."""
        found, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                found.append(node)
        return found

    def evict(self, leaf: _Node) -> None:
        """Drop ``leaf`` (a node without children), remembering its path."""
        assert leaf.parent is not None and not leaf.children
        self._owner.remember_evicted(self, leaf.path())
        del leaf.parent.children[leaf.tokens[0]]
        leaf.parent = None
        self.nbytes -= leaf.nbytes

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after its first ``at`` tokens; returns the new head (the tail keeps the children)."""
        assert node.parent is not None and 0 < at < len(node.tokens)
        head = _Node(node.tokens[:at], _copied(node.layers, 0, at), node.parent)
        head.last_used = node.last_used
        node.parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.layers = _copied(node.layers, at, None)
        node.parent = head
        head.children[node.tokens[0]] = node
        return head


class PrefixTrees:
    """One :class:`PrefixTree` per (model, pool digest), all under one byte budget (least recently used leaves
    evicted first). Every method is safe to call from any thread.

    Args:
        max_bytes: Budget for the keys and values stored in all trees.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            msg = f"max_bytes must be a non-negative number of bytes, got {max_bytes!r}"
            raise ValueError(msg)
        self.max_bytes = max_bytes
        self.lock = threading.RLock()
        self._trees: weakref.WeakKeyDictionary[PreTrainedModel, dict[str, PrefixTree]] = weakref.WeakKeyDictionary()
        self._clock = itertools.count(1)
        # The latest evicted paths, as (their tree's key, tokens): a bounded memory, whatever the number of pools.
        self._evicted: deque[tuple[tuple[int, str], tuple[int, ...]]] = deque(maxlen=EVICTED_PATHS_KEPT)
        self.hits = 0
        """Calls that found a stored prefix."""
        self.matched_tokens = 0
        """Tokens those calls found stored (a call may read fewer: rows admitted together are aligned)."""
        self.evictions = 0
        """Nodes evicted by the budget."""

    def __repr__(self) -> str:
        return (
            f"PrefixTrees(nbytes={self.nbytes}, max_bytes={self.max_bytes}, hits={self.hits}, "
            f"matched_tokens={self.matched_tokens}, evictions={self.evictions})"
        )

    def tick(self) -> int:
        """The next time stamp of the least-recently-used order."""
        return next(self._clock)

    def match(self, model: PreTrainedModel, pool_digest: str, tokens: Sequence[int], limit: int) -> PrefixMatch:
        """:meth:`PrefixTree.match` in the tree of ``(model, pool_digest)``."""
        with self.lock:
            return self.tree(model, pool_digest).match(tokens, limit)

    def insert(self, model: PreTrainedModel, pool_digest: str, tokens: Sequence[int], layers: Sequence[LayerKV]) -> int:
        """:meth:`PrefixTree.insert` into the tree of ``(model, pool_digest)``, looked up under the lock, so that
        no eviction can drop it in between."""
        with self.lock:
            return self.tree(model, pool_digest).insert(tokens, layers)

    def tree(self, model: PreTrainedModel, pool_digest: str) -> PrefixTree:
        """The tree of calls over the pool ``pool_digest`` on ``model`` (made on first use). An eviction drops a
        tree left empty: hold the lock between looking one up and storing into it (:meth:`insert` does)."""
        with self.lock:
            per_model = self._trees.setdefault(model, {})
            if pool_digest not in per_model:
                per_model[pool_digest] = PrefixTree(self, (id(model), pool_digest))
            return per_model[pool_digest]

    def remember_evicted(self, tree: PrefixTree, path: tuple[int, ...]) -> None:
        """Note that ``tree`` no longer holds ``path``."""
        self._evicted.append((tree.key, path))

    def evicted_past(self, tree: PrefixTree, tokens: Sequence[int], matched: int) -> int:
        """How far past ``matched`` a path evicted from ``tree`` still agreed with ``tokens``."""
        longest = max((common_length(path, tokens) for key, path in self._evicted if key == tree.key), default=0)
        return max(0, longest - matched)

    @property
    def nbytes(self) -> int:
        """Bytes stored in all trees."""
        with self.lock:
            return sum(tree.nbytes for trees in self._trees.values() for tree in trees.values())

    def evict_over_budget(self) -> None:
        """Evict least recently used leaves until the stored bytes fit the budget. A tree left empty is dropped: a
        server that reads many pools over time keeps trees for the recent ones only."""
        with self.lock:
            trees = [
                (per_model, digest, tree) for per_model in self._trees.values() for digest, tree in per_model.items()
            ]
            total = sum(tree.nbytes for _, _, tree in trees)
            while total > self.max_bytes:
                candidates = [(leaf.last_used, i, leaf) for i, (*_, tree) in enumerate(trees) for leaf in tree.leaves()]
                if not candidates:
                    break
                _, i, leaf = min(candidates, key=lambda c: (c[0], c[1]))
                total -= leaf.nbytes
                trees[i][2].evict(leaf)
                self.evictions += 1
            for per_model, digest, tree in trees:
                if tree.empty and per_model.get(digest) is tree:
                    del per_model[digest]
