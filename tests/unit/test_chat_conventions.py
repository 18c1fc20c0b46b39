"""What a ChatOllama or ChatHuggingFace user expects of ChatPolyKV at the edges: settings that are not ours
refused by name, token counts by the model's own tokenizer, a clear error for a missing device, the
sampling settings they know, the standard parameters, and metadata that names the provider."""

from __future__ import annotations

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models import BaseLanguageModel
from langchain_core.messages import HumanMessage, SystemMessage

from polykv_agents import ChatPolyKV, DeviceNotAvailableError, PoolHandle, PoolStore, PrefetchDocument, load_model
from polykv_agents.model.device import resolve_device
from polykv_agents.prompting.encode import encode_prompt

MESSAGES = [SystemMessage("You are the critic."), HumanMessage("What do values use? Answer, then say it again.")]


def test_the_integration_is_imported_from_the_package_root():
    assert ChatPolyKV.__module__ == "polykv_agents.chat.chat_model"
    assert {PrefetchDocument, PoolHandle, PoolStore}


@pytest.mark.parametrize("alias", ["model_name", "model_id"])
def test_model_name_and_model_id_name_the_model(alias):
    assert ChatPolyKV(**{alias: "some/model"}).model == "some/model"
    with pytest.raises(ValueError, match="name different models"):
        ChatPolyKV(model="a", **{alias: "b"})


@pytest.mark.parametrize(
    ("setting", "pointed_to"),
    [("max_new_tokens", "max_tokens"), ("num_predict", "max_tokens"), ("repeat_penalty", "repetition_penalty")],
)
def test_other_integrations_names_are_refused_naming_ours(setting, pointed_to):
    with pytest.raises(ValueError, match=f"no setting '{setting}': use '{pointed_to}' instead"):
        ChatPolyKV(**{setting: 5})


def test_a_misspelt_setting_is_refused_with_the_closest_names():
    with pytest.raises(ValueError, match="no setting 'temprature'; did you mean 'temperature'"):
        ChatPolyKV(temprature=0.2)


def test_a_call_keyword_no_call_reads_is_refused(tiny_model_dir):
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=3)
    with pytest.raises(ValueError, match="a ChatPolyKV call has no setting 'max_new_tokens': use 'max_tokens'"):
        chat.invoke(MESSAGES, max_new_tokens=5)
    assert chat.invoke(MESSAGES, max_tokens=2, ignore_eos=True).usage_metadata["output_tokens"] == 2


def test_langchains_standard_parameters_construct_and_timeout_and_streaming_work(tiny_model_dir):
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=6, ignore_eos=True, timeout=60, max_retries=2, stop=[])
    assert chat.invoke(MESSAGES).usage_metadata["output_tokens"] == 6

    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs) -> None:
            self.tokens.append(token)

    for streaming, expect_tokens in ((False, False), (True, True)):
        handler = Tokens()
        reply = chat.model_copy(update={"streaming": streaming}).invoke(MESSAGES, config={"callbacks": [handler]})
        assert bool(handler.tokens) is expect_tokens
        if expect_tokens:
            assert "".join(handler.tokens) == reply.content

    with pytest.raises(TimeoutError, match="ran past timeout=1e-09 s"):
        chat.model_copy(update={"timeout": 1e-9}).invoke(MESSAGES)


def test_token_counts_use_the_models_own_tokenizer_never_the_network(tiny_model_dir, monkeypatch):
    def no_network(*args, **kwargs):
        pytest.fail("LangChain's default (GPT-2 from the network) was used")

    monkeypatch.setattr(BaseLanguageModel, "get_token_ids", no_network)
    chat = ChatPolyKV(model=tiny_model_dir)
    _, tokenizer = load_model(tiny_model_dir)
    text = "Keys are int8; values are three-bit codes."
    assert chat.get_token_ids(text) == tokenizer.encode(text, add_special_tokens=False)
    assert chat.get_num_tokens(text) == len(tokenizer.encode(text, add_special_tokens=False))
    from polykv_agents.chat.messages import to_chat_messages

    rendered = encode_prompt(tokenizer, to_chat_messages(MESSAGES))
    assert chat.get_num_tokens_from_messages(MESSAGES) == rendered.numel()

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    assert chat.get_num_tokens_from_messages(MESSAGES, tools=[multiply]) > rendered.numel()  # the tools are shown


def test_device_auto_resolves_and_a_missing_device_says_what_to_use(tiny_model_dir):
    has_mps = torch.backends.mps.is_available()
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu")
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(DeviceNotAvailableError, match="not a device name"):
        resolve_device("gpu0")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceNotAvailableError, match=r"device='cuda' is not available: .* Use device='cpu'"):
        ChatPolyKV(model=tiny_model_dir, device="cuda").invoke(MESSAGES)
    reply = ChatPolyKV(model=tiny_model_dir, device="auto", max_tokens=2).invoke(MESSAGES)
    assert reply.response_metadata["model_provider"] == "polykv"


def test_repetition_penalty_decodes_what_transformers_decodes(tiny_model_dir):
    """Without a pool the prompt is the whole input, so the penalty reads what transformers' does: the same
    greedy tokens as ``model.generate(..., repetition_penalty=1.5)``, and other tokens than without it."""
    model, tokenizer = load_model(tiny_model_dir)
    from polykv_agents.chat.messages import to_chat_messages

    ids = encode_prompt(tokenizer, to_chat_messages(MESSAGES)).unsqueeze(0)
    kwargs = {"max_new_tokens": 16, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        expected = model.generate(ids, repetition_penalty=1.5, **kwargs)[0, ids.shape[1] :]
        plain = model.generate(ids, **kwargs)[0, ids.shape[1] :]
    assert not torch.equal(expected, plain)  # the penalty changes this answer
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=16, repetition_penalty=1.5)
    assert chat.invoke(MESSAGES).content == tokenizer.decode(expected, skip_special_tokens=True)


def test_sampling_settings_are_per_row_in_the_batched_runtime(tiny_model_dir):
    """Over a pool, rows with and without a repetition penalty decode in one batch; each row's answer is the one
    the private runtime (one cache per call, no batching) decodes with the same settings."""
    from concurrent.futures import ThreadPoolExecutor

    from polykv_agents import SharedKVPool

    model, tokenizer = load_model(tiny_model_dir)
    pool = SharedKVPool.prefill(
        model, tokenizer, [{"role": "user", "content": "Values use a three-bit codebook. " * 8}]
    )
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=16, ignore_eos=True).with_pool(pool)
    settings = [{}, {"repetition_penalty": 1.5}, {"repetition_penalty": 0.7}, {"top_k": 1, "temperature": 1.0}]

    def answer(runtime: str, call: dict) -> str:
        return chat.model_copy(update={"runtime": runtime}).invoke(MESSAGES, **call).content

    with ThreadPoolExecutor(len(settings)) as executor:
        batched = list(executor.map(lambda call: answer("decompressed", call), settings))
    private = [answer("private", call) for call in settings]
    assert batched == private
    assert len({batched[0], batched[1], batched[2]}) == 3  # each penalty changed the answer
    assert batched[3] == batched[0]  # top_k=1 samples the greedy token


def test_response_metadata_names_the_provider_where_the_time_went_and_where_the_pool_came_from(
    tiny_model_dir, tmp_path
):
    from polykv_agents import Engine, SharedKVPool

    model, tokenizer = load_model(tiny_model_dir)
    document = [{"role": "user", "content": "Values use a three-bit codebook. " * 8}]
    store = PoolStore(tmp_path)
    pool = SharedKVPool.prefill(model, tokenizer, document)
    saved = store.save(pool)
    handle = PoolHandle.from_pool(pool, store_dir=tmp_path)
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=4, ignore_eos=True).with_pool(handle, document=document)

    def metadata(engine: Engine) -> dict:
        return chat.model_copy(update={"engine": engine}).invoke(MESSAGES).response_metadata

    engine = Engine()
    first, second = metadata(engine), metadata(engine)
    assert first["model_provider"] == "polykv"
    assert (first["pool_source"], second["pool_source"]) == ("store", "registry")
    for seconds in ("queue_s", "prefill_s", "decode_s"):
        assert 0 <= first[seconds] < 60, seconds
    saved.unlink()  # the store lost its copy: the call rebuilds the pool from its document
    assert metadata(Engine())["pool_source"] == "built"


def test_configurable_fields_set_a_setting_per_run(tiny_model_dir):
    """The README's init_chat_model-style configuration: a field made configurable is set per run by config."""
    from langchain_core.runnables import ConfigurableField

    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=8, ignore_eos=True).configurable_fields(
        max_tokens=ConfigurableField(id="max_tokens", name="Max tokens")
    )
    assert chat.invoke(MESSAGES).usage_metadata["output_tokens"] == 8
    configured = chat.invoke(MESSAGES, config={"configurable": {"max_tokens": 3}})
    assert configured.usage_metadata["output_tokens"] == 3
    with pytest.raises(ValueError, match="no setting 'max_new_tokens'"):
        chat.with_config(configurable={"max_tokens": 3}).invoke(MESSAGES, max_new_tokens=2)


def test_logprobs_report_each_answer_tokens_log_probability_in_chatopenais_form(tiny_model_dir):
    """Without a pool the prompt is the whole input, so the first token's logprobs are a plain forward's."""
    model, tokenizer = load_model(tiny_model_dir)
    from polykv_agents.chat.messages import to_chat_messages

    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    reply = chat.invoke(MESSAGES)
    content = reply.response_metadata["logprobs"]["content"]
    assert len(content) == reply.usage_metadata["output_tokens"] == 6
    assert "".join(item["token"] for item in content) == reply.text
    for item in content:  # greedy: the chosen token is the most likely one
        assert [alt["logprob"] for alt in item["top_logprobs"]] == sorted(
            (alt["logprob"] for alt in item["top_logprobs"]), reverse=True
        )
        assert item["top_logprobs"][0]["token"] == item["token"]
        assert item["logprob"] == item["top_logprobs"][0]["logprob"] <= 0
        assert item["top_logprobs"][0]["bytes"] == item["bytes"]
    # The tokens' own bytes, joined, are the answer's bytes (decoded as the tokenizer decodes a partial character).
    assert b"".join(bytes(item["bytes"]) for item in content).decode("utf-8", errors="replace") == reply.text
    ids = encode_prompt(tokenizer, to_chat_messages(MESSAGES)).unsqueeze(0)
    with torch.inference_mode():
        expected = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
    assert content[0]["logprob"] == pytest.approx(float(expected.max()), abs=1e-5)
    assert "logprobs" not in ChatPolyKV(model=tiny_model_dir, max_tokens=2).invoke(MESSAGES).response_metadata
    with pytest.raises(ValueError, match="needs logprobs=True"):
        ChatPolyKV(model=tiny_model_dir, max_tokens=2).invoke(MESSAGES, top_logprobs=2)


def test_logprobs_are_per_row_in_the_batched_runtime_and_are_the_models_not_the_samplers(tiny_model_dir):
    """Batched rows report what the private runtime reports; a repetition penalty changes the chosen tokens, not
    the log-probabilities of the model's own distribution they are scored under."""
    from concurrent.futures import ThreadPoolExecutor

    from polykv_agents import SharedKVPool

    model, tokenizer = load_model(tiny_model_dir)
    pool = SharedKVPool.prefill(
        model, tokenizer, [{"role": "user", "content": "Values use a three-bit codebook. " * 8}]
    )
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=1)
    chat = chat.with_pool(pool)
    settings = [{}, {"repetition_penalty": 1.8}, {"logprobs": False}]

    def answer(runtime: str, call: dict) -> dict:
        return chat.model_copy(update={"runtime": runtime}).invoke(MESSAGES, **call).response_metadata

    with ThreadPoolExecutor(len(settings)) as executor:
        batched = list(executor.map(lambda call: answer("decompressed", call), settings))
    private = [answer("private", call) for call in settings[:2]]
    for got, want in zip(batched[:2], private, strict=True):
        assert [i["token"] for i in got["logprobs"]["content"]] == [i["token"] for i in want["logprobs"]["content"]]
        assert [i["logprob"] for i in got["logprobs"]["content"]] == pytest.approx(
            [i["logprob"] for i in want["logprobs"]["content"]], abs=1e-4
        )
    assert "logprobs" not in batched[2]
    penalized = batched[1]["logprobs"]["content"]
    assert any(item["logprob"] < item["top_logprobs"][0]["logprob"] for item in penalized)


def test_logprobs_under_a_grammar_are_the_models_own_not_the_masked_distribution(tiny_model_dir):
    """A forced tool call's tokens are ones the random tiny model finds unlikely: their logprobs say so (a masked
    distribution would give a forced token logprob 0)."""

    def switch(on: bool) -> str:
        """Switch the light on or off."""
        return "done"

    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=120, logprobs=True, top_logprobs=2)
    reply = chat.bind_tools([switch], tool_choice="any").invoke("Switch the light on.")
    assert reply.tool_calls
    content = reply.response_metadata["logprobs"]["content"]
    assert len(content) == reply.usage_metadata["output_tokens"]
    assert sum(item["logprob"] < item["top_logprobs"][0]["logprob"] for item in content) > len(content) // 2
