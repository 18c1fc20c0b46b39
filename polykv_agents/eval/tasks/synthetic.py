"""RULER's synthetic tasks, generated here (no download): needle retrieval in three variants, variable
tracking and common-word extraction. Each generator makes one :class:`~.items.TaskItem` from a seeded
``random.Random``, so a run is reproducible and every item is an independent sample (its own filler, needles,
keys and values).

The wording follows RULER's templates (Hsieh et al., 2024); the question is asked by a role after the pooled
document, as the graphs ask, so RULER's trailing answer prefixes are left out.
"""

from __future__ import annotations

import itertools
import random
import re
import string
from collections.abc import Callable
from functools import cache

from polykv_agents.eval.corpus import pydoc_documents
from polykv_agents.eval.tasks.haystack import Haystack
from polykv_agents.eval.tasks.items import TaskItem

ADJECTIVES = (
    "amber", "bold", "brisk", "calm", "clever", "crimson", "dusty", "eager", "fancy", "gentle", "golden", "hollow",
    "humble", "icy", "jolly", "lively", "lucky", "mellow", "misty", "noble", "olive", "plain", "proud", "quiet",
    "rapid", "rustic", "scarlet", "shiny", "silent", "silver", "sleepy", "smooth", "steady", "sunny", "tidy",
    "vivid", "wary", "witty", "young", "zesty",
)  # fmt: skip
NOUNS = (
    "anchor", "badger", "basket", "beacon", "bridge", "candle", "canyon", "castle", "cedar", "comet", "compass",
    "falcon", "garden", "glacier", "harbor", "helmet", "island", "kettle", "lantern", "meadow", "mirror", "orchard",
    "otter", "pebble", "pepper", "pillow", "planet", "quarry", "rabbit", "river", "saddle", "signal", "spruce",
    "tunnel", "valley", "violin", "walnut", "willow", "window", "zebra",
)  # fmt: skip

NEEDLE = "One of the special magic numbers for {key} is: {value}."
NEEDLE_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
MULTIVALUE_QUESTION = "What are all the special magic numbers for {key} mentioned in the provided text?"
VARIABLE_QUESTION = "Find all variables that are assigned the value {value} in the text above."
COMMON_WORDS_QUESTION = "What are the {count} most common words in the above list?"
NEEDLE_ANSWER = "The special magic number for {key} mentioned in the provided text is"
MULTIVALUE_ANSWER = "The special magic numbers for {key} mentioned in the provided text are"
VARIABLE_ANSWER = (
    "According to the chain(s) of variable assignment in the text above, {count} variables are assigned the value "
    "{value}, they are:"
)
COMMON_WORDS_ANSWER = "The top {count} words that appear most often in the list are:"


def magic_number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def magic_keys(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct adjective-noun keys."""
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], count)
    return [f"{adjective}-{noun}" for adjective, noun in pairs]


def niah_single(haystack: Haystack, context_tokens: int, rng: random.Random) -> TaskItem:
    """One needle in the filler; its number is asked for."""
    (key,), value = magic_keys(rng, 1), magic_number(rng)
    document = haystack.document([NEEDLE.format(key=key, value=value)], context_tokens, rng)
    return TaskItem(
        "niah_single", document, NEEDLE_QUESTION.format(key=key), (value,), "all", 32, NEEDLE_ANSWER.format(key=key)
    )


def niah_multikey(haystack: Haystack, context_tokens: int, rng: random.Random, keys: int = 4) -> TaskItem:
    """``keys`` needles with different keys (the others are distractors); one key's number is asked for."""
    names = magic_keys(rng, keys)
    values = [magic_number(rng) for _ in names]
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(names, values, strict=True)]
    asked = rng.randrange(keys)
    document = haystack.document(needles, context_tokens, rng)
    return TaskItem(
        "niah_multikey", document, NEEDLE_QUESTION.format(key=names[asked]), (values[asked],), "all", 32,
        NEEDLE_ANSWER.format(key=names[asked]),
    )  # fmt: skip


def niah_multivalue(haystack: Haystack, context_tokens: int, rng: random.Random, values: int = 4) -> TaskItem:
    """``values`` needles with one key and different numbers; all of them are asked for."""
    (key,) = magic_keys(rng, 1)
    numbers = [magic_number(rng) for _ in range(values)]
    document = haystack.document([NEEDLE.format(key=key, value=v) for v in numbers], context_tokens, rng)
    return TaskItem(
        "niah_multivalue", document, MULTIVALUE_QUESTION.format(key=key), tuple(numbers), "all", 64,
        MULTIVALUE_ANSWER.format(key=key),
    )  # fmt: skip


def variable_tracking(haystack: Haystack, context_tokens: int, rng: random.Random, hops: int = 4) -> TaskItem:
    """A chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (``hops`` links) spread through the filler in order;
    every variable holding the value is asked for."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    document = haystack.document(chain, context_tokens, rng)
    return TaskItem(
        "variable_tracking", document, VARIABLE_QUESTION.format(value=value), tuple(names), "all", 48,
        VARIABLE_ANSWER.format(count=len(names), value=value),
    )  # fmt: skip


@cache
def _vocabulary() -> tuple[str, ...]:
    """Lower-case words of 5 to 10 letters from the pydoc corpus, in a fixed order: the word list's words."""
    words = re.findall(r"\b[a-z]{5,10}\b", "\n".join(pydoc_documents(1, chars_per_document=400_000)))
    return tuple(sorted(set(words)))


def common_words(
    haystack: Haystack, context_tokens: int, rng: random.Random, count: int = 10, common: int = 30, rare: int = 3
) -> TaskItem:
    """RULER's common-word extraction: a numbered list in which ``count`` words appear ``common`` times each
    (fewer in a short context: at most half the list) and as many others as fit ``rare`` times each; the
    ``count`` most common words are asked for."""
    vocabulary = list(_vocabulary())
    rng.shuffle(vocabulary)
    frequent, others = vocabulary[:count], vocabulary[count:]
    entries = context_tokens // (haystack.tokens("999. plentiful\n") + 1)  # numbered entries that fit, about
    common = min(common, entries // (2 * count))
    if common <= rare:
        msg = f"{context_tokens} tokens cannot hold {count} words more often than {rare} times each"
        raise ValueError(msg)
    words = frequent * common + others[: (entries - count * common) // rare] * rare
    rng.shuffle(words)
    document = "\n".join(f"{i}. {word}" for i, word in enumerate(words, 1))
    return TaskItem(
        "common_words", document, COMMON_WORDS_QUESTION.format(count=count), tuple(frequent), "all", 64,
        COMMON_WORDS_ANSWER.format(count=count),
    )  # fmt: skip


Generator = Callable[[Haystack, int, random.Random], TaskItem]

SYNTHETIC_TASKS: dict[str, Generator] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
}
"""RULER's synthetic tasks by name."""
