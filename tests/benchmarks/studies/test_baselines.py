"""Benchmark baselines: the pinned plan that makes the end-to-end comparison equal work."""

from __future__ import annotations


def test_a_pinned_plan_makes_any_model_decode_the_same_plan(tiny_model_dir):
    """The end-to-end benchmark pins the planner's answer, so a compressed and a full-precision document
    cannot lead to plans of different lengths (unequal work)."""
    from langchain_core.messages import HumanMessage

    from benchmarks.studies.baselines import PinnedPlanPrefetch, PinnedPlanReprefill, pinned_schema
    from polykv_agents.chat.chat_model import ChatPolyKV

    schema = {
        "title": "ReviewPlan",
        "type": "object",
        "properties": {"legal": {"type": "string", "pattern": "^[a-z ]{1,60}$"}, "risk": {"type": "string"}},
        "required": ["legal", "risk"],
        "additionalProperties": False,
    }
    plan = {"legal": "the contracts", "risk": "what could fail"}
    assert pinned_schema(schema, plan)["properties"]["legal"] == {"type": "string", "const": "the contracts"}
    assert schema["properties"]["legal"]["pattern"] == "^[a-z ]{1,60}$"  # the original is left alone
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=64)
    state = {"document": "A short document about contracts and failures. " * 4}
    for node in (PinnedPlanPrefetch, PinnedPlanReprefill):
        prefetch = node(chat, plan=lambda roles: {role: plan[role] for role in roles})
        state = {**state, **prefetch(state)}
        parsed, raw = prefetch.invoke_role_structured(state, "planner", [HumanMessage("Plan it.")], schema)
        assert parsed == plan and raw.name == "planner"


def test_the_reprefill_engine_prefills_each_whole_prompt_with_the_chunked_prefill(tiny_model_dir, monkeypatch):
    """The no-pool baseline's calls prefill as the time-to-first-token baseline does (``prefill_cache``, the
    document in front of the call's own turns), and decode the same greedy tokens as the private runtime's
    single forward."""
    from benchmarks.studies import baselines
    from benchmarks.studies.baselines import ReprefillDocument, ReprefillEngine
    from polykv_agents.chat.chat_model import ChatPolyKV
    from polykv_agents.engine import Engine

    prefilled: list[int] = []

    def spied_prefill(model, ids, **kwargs):
        prefilled.append(ids.numel())
        return baselines_prefill(model, ids, chunk_size=7)  # several chunks even for a short document

    baselines_prefill = baselines.prefill_cache
    monkeypatch.setattr(baselines, "prefill_cache", spied_prefill)
    state = {"document": "A short document about contracts and failures. " * 4}
    replies = {}
    for name, engine in (("chunked", ReprefillEngine()), ("one forward", Engine())):
        baseline = ReprefillDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=6, engine=engine), engine=engine)
        replies[name] = baseline.pooled_chat(state).invoke("Summarise.")
    chunked, single = replies["chunked"], replies["one forward"]
    assert prefilled == [chunked.usage_metadata["input_tokens"]]  # one prefill: the whole prompt, once
    assert chunked.content == single.content and chunked.usage_metadata == single.usage_metadata
