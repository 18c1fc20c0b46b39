"""Grammar-constrained decoding and with_structured_output, on tiny random models: whatever the model
would say, the answer parses and validates."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import pytest
import torch
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage
from pydantic import BaseModel, ConfigDict, Field
from tiny_models import tiny_sensitive_llama
from typing_extensions import TypedDict

from polykv_agents import GenerationSettings, PooledAgent, SharedKVPool, load_model
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.sampling.grammar import GrammarError, TokenConstraint, closed_schema, json_schema_grammar

DOC = "Shared caches let many agents read one document. Values use a rotated three-bit codebook. " * 4


class Finding(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, or keys could go on forever
    # Bounded strings: a random model under temperature never closes an unbounded one within the budget.
    title: str = Field(max_length=20)
    severity: int = Field(ge=1, le=5)
    tags: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3)


class FindingDict(TypedDict):
    severity: Literal["low", "high"]
    urgent: bool


@pytest.fixture(scope="module")
def sensitive():
    """A tiny Llama whose greedy answers depend on the prompt, and a pool over DOC."""
    from tiny_models import tiny_tokenizer

    model, tokenizer = tiny_sensitive_llama(), tiny_tokenizer()
    return model, tokenizer, SharedKVPool.prefill(model, tokenizer, DOC)


@pytest.fixture
def chat(tiny_model_dir) -> ChatPolyKV:
    model, tokenizer = load_model(tiny_model_dir)
    return ChatPolyKV(model=tiny_model_dir, max_tokens=400).with_pool(SharedKVPool.prefill(model, tokenizer, DOC))


@pytest.mark.parametrize("runtime", ["private", "decompressed"])
@pytest.mark.parametrize("seed", range(4))
def test_sampled_answers_under_a_schema_always_validate(sensitive, runtime, seed):
    model, tokenizer, pool = sensitive
    settings = GenerationSettings(
        max_new_tokens=400, temperature=1.2, seed=seed, grammar=json_schema_grammar(Finding.model_json_schema())
    )
    ids = list(PooledAgent(pool, model, tokenizer, runtime=runtime).generate_ids("Report one finding.", settings))
    Finding.model_validate_json(tokenizer.decode(ids))  # raises if the JSON or the schema is violated


def test_constrained_and_free_agents_share_a_batch_without_changing_each_other(sensitive):
    """Each row keeps its own grammar state; rows without one decode exactly as they do alone."""
    model, tokenizer, pool = sensitive
    grammar = json_schema_grammar(Finding.model_json_schema())
    free = GenerationSettings(max_new_tokens=20)
    constrained = GenerationSettings(max_new_tokens=400, grammar=grammar)
    jobs = [(f"Role {i}.", free if i % 2 else constrained) for i in range(6)]

    def run(job, runtime):
        role, settings = job
        return list(
            PooledAgent(pool, model, tokenizer, system_prompt=role, runtime=runtime).generate_ids("Go.", settings)
        )

    alone = [run(job, "private") for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as executor:
        together = list(executor.map(lambda job: run(job, "decompressed"), jobs))
    assert together == alone
    for (_, settings), ids in zip(jobs, together, strict=True):
        if settings.grammar is not None:
            Finding.model_validate_json(tokenizer.decode(ids))


@pytest.mark.parametrize(
    "schema",
    [Finding, FindingDict, Finding.model_json_schema()],
    ids=["pydantic", "typeddict", "json-schema"],
)
def test_with_structured_output_returns_parsed_objects(chat, schema):
    result = chat.with_structured_output(schema).invoke("Report one finding.")
    if schema is Finding:
        assert isinstance(result, Finding)
    elif schema is FindingDict:
        assert result["severity"] in ("low", "high") and isinstance(result["urgent"], bool)
    else:
        Finding.model_validate(result)


def test_include_raw_returns_the_message_and_the_parsed_object(chat):
    result = chat.with_structured_output(Finding, include_raw=True).invoke("Report one finding.")
    assert isinstance(result["raw"], AIMessage)
    assert result["parsing_error"] is None
    assert result["parsed"] == Finding.model_validate_json(result["raw"].content)
    assert result["raw"].response_metadata["finish_reason"] == "stop"  # the grammar ended the answer


def test_json_mode_constrains_to_a_json_object(chat):
    """Any JSON object is unbounded, and a random model never closes its first string: the answer is
    the start of an object, cut by the budget (SmolLM2 completes it: tests/integration)."""
    result = chat.with_structured_output(method="json_mode", include_raw=True).invoke("Anything, as JSON.")
    if result["parsed"] is None:
        assert result["raw"].content.startswith('{"')
        assert result["raw"].response_metadata["finish_reason"] == "length"
    else:
        assert isinstance(result["parsed"], dict)


def test_a_stop_sequence_inside_the_json_does_not_cut_it(chat):
    """Stop sequences act on text; under a grammar the grammar decides the end, so '"' cannot cut a string."""
    result = chat.with_structured_output(Finding).invoke("Report one finding.", stop=['"', "}"])
    assert isinstance(result, Finding)


@pytest.mark.parametrize("schema", [Finding, FindingDict], ids=["pydantic", "typeddict"])
def test_an_answer_cut_by_max_tokens_is_a_parsing_error_not_a_partial_object(chat, schema):
    short = chat.model_copy(update={"max_tokens": 3})
    result = short.with_structured_output(schema, include_raw=True).invoke("Report one finding.")
    assert result["parsed"] is None
    assert isinstance(result["parsing_error"], OutputParserException)
    assert result["raw"].response_metadata["finish_reason"] == "length"
    with pytest.raises(OutputParserException):
        short.with_structured_output(schema).invoke("Report one finding.")


def test_a_schema_that_cannot_be_compiled_fails_at_bind_time(chat):
    with pytest.raises(GrammarError, match="Invalid type: strng"):
        chat.with_structured_output({"title": "x", "type": "object", "properties": {"a": {"type": "strng"}}})
    with pytest.raises(GrammarError, match="does not exist"):
        json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})


def test_unknown_methods_and_arguments_are_clear_errors(chat):
    with pytest.raises(ValueError, match="method must be one of json_schema, json_mode, function_calling"):
        chat.with_structured_output(Finding, method="xml")
    with pytest.raises(ValueError, match="needs a schema"):
        chat.with_structured_output(None)
    with pytest.raises(ValueError, match="unsupported arguments"):
        chat.with_structured_output(Finding, temperature=0.5)
    with pytest.raises(GrammarError, match="response_format must be"):
        chat.invoke("Go.", response_format={"type": "xml"})


def test_the_grammar_is_plain_json_text(chat):
    """What reaches the decode loop is a string: settings stay frozen, hashable and serializable."""
    grammar = json_schema_grammar(Finding.model_json_schema())
    assert json.loads(grammar)["grammars"]
    assert hash(GenerationSettings(grammar=grammar))


@pytest.mark.parametrize("runtime", ["private", "decompressed"])
def test_masking_works_on_bf16_inference_logits(runtime, tiny_tok):
    """The mask is applied in place to the forward pass's inference tensors, in the model's dtype."""
    model = tiny_sensitive_llama().to(torch.bfloat16)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    settings = GenerationSettings(max_new_tokens=400, grammar=json_schema_grammar(Finding.model_json_schema()))
    ids = list(PooledAgent(pool, model, tiny_tok, runtime=runtime).generate_ids("Report one finding.", settings))
    Finding.model_validate_json(tiny_tok.decode(ids))


def test_a_failing_grammar_ends_only_its_own_row(sensitive, monkeypatch):
    """Any failure inside one request's grammar reaches that caller; the rows beside it decode on."""
    model, tokenizer, pool = sensitive
    free = GenerationSettings(max_new_tokens=20)
    alone = [
        list(
            PooledAgent(pool, model, tokenizer, system_prompt=f"Role {i}.", runtime="private").generate_ids("Go.", free)
        )
        for i in range(3)
    ]

    def broken(self, token):
        raise RuntimeError("grammar engine failure")

    monkeypatch.setattr(TokenConstraint, "advance", broken)
    constrained = GenerationSettings(max_new_tokens=50, grammar=json_schema_grammar(Finding.model_json_schema()))

    def run(i):
        agent = PooledAgent(pool, model, tokenizer, system_prompt=f"Role {i}.")
        if i == 3:
            with pytest.raises(RuntimeError, match="grammar engine failure"):
                list(agent.generate_ids("Go.", constrained))
            return None
        return list(agent.generate_ids("Go.", free))

    with ThreadPoolExecutor(4) as executor:
        results = list(executor.map(run, range(4)))
    assert results[:3] == alone


def test_ignore_eos_and_a_grammar_cannot_be_combined():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with a grammar"):
        GenerationSettings(ignore_eos=True, grammar=json_schema_grammar({"type": "object"}))


def test_closing_objects_touches_only_schema_positions():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "default": {"properties": 1},
        "allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}],
    }
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in closed["properties"]  # the mapping of properties is not a schema
    assert closed["default"] == {"properties": 1}  # data, not schema
    assert closed["allOf"] == schema["allOf"]  # closing each member would make the combination unsatisfiable
    json_schema_grammar(closed)


def test_the_mask_matches_llguidances_own_reference_at_every_step(tiny_tok):
    """Our bit unpacking (numpy, any dtype or device) against llguidance's numpy kernel, along a whole answer."""
    import llguidance.numpy
    import numpy as np

    text = '{"title":"drought","severity":4,"tags":["water","risk"]}'  # compact: the grammar allows no free spaces
    constraint = TokenConstraint(json_schema_grammar(Finding.model_json_schema()), tiny_tok, 330, [2])
    for token in [*tiny_tok(text, add_special_tokens=False).input_ids, 2]:
        logits = torch.randn(330)
        expected = logits.numpy().copy()[None]
        llguidance.numpy.fill_next_token_bitmask(constraint._matcher, bitmask := np.zeros((1, 11), np.int32))
        llguidance.numpy.apply_token_bitmask_inplace(expected, bitmask)
        assert torch.equal(constraint.mask_(logits.clone()), torch.from_numpy(expected[0]))
        constraint.advance(token)
    assert constraint.finished
