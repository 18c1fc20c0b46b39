"""The LangGraph workflows (graphs/) and their examples on the real embedded model.

What is checked is structure and measured facts, never answer quality (SmolLM2-135M is tiny): one
pool build per document, every call reading the whole pool (cache_read less reused tokens == pool tokens), one record
per role, checkpoints that hold a PoolHandle and no tensors, parallel branches equal to sequential
greedy calls, and clear errors for bad input. Documents are short (~90 tokens) and answers 8 tokens,
so the whole module runs in about a minute on two cores once the model is loaded.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `graphs` lives at the repository root, outside the package

from usage import pool_read, reused  # noqa: E402

from graphs import document_review, role_swarm  # noqa: E402
from polykv_agents import default_engine  # noqa: E402
from polykv_agents.chat.chat_model import ChatPolyKV  # noqa: E402
from polykv_agents.graph.prefetch import PrefetchDocument  # noqa: E402
from polykv_agents.pool.handle import PoolHandle  # noqa: E402
from polykv_agents.pool.registry import PoolNotFoundError  # noqa: E402

pytestmark = pytest.mark.real_model

MAX_TOKENS = 8
QUESTION = "What is the main risk?"
BASE_DOCUMENT = (
    "Minutes of the Riverside town council, 4 March. The council approved a budget of 4 million euros for "
    "road repairs, a new library in the north district and two extra bus lines. The opposition warned that "
    "the library could cost more than planned and that bus drivers are hard to hire. The vote was 7 to 4."
)
# 15 distinct roles per graph: the known prompts first, then roles that get the generic prompt.
ROLES_15 = {
    "document_review": [*document_review.ROLE_PROMPTS, "procurement", "quality", "audit", "strategy", "data"],
    "role_swarm": [
        *role_swarm.ROLE_PROMPTS,
        "mayor",
        "driver",
        "librarian",
        "teacher",
        "auditor",
        "nurse",
        "farmer",
        "pupil",
    ],
}
assert all(len(set(roles)) == 15 for roles in ROLES_15.values())
ROLES_3 = {"document_review": ["legal", "finance", "risk"], "role_swarm": ["analyst", "skeptic", "customer"]}
GRAPHS = {"document_review": document_review, "role_swarm": role_swarm}
RECORDS = {"document_review": "findings", "role_swarm": "answers"}
FINAL = {"document_review": "summary", "role_swarm": "answer"}
FIXED_STAGES = {"document_review": ["planner", "critic", "summarizer"], "role_swarm": ["aggregator"]}


def document(tag: str) -> str:
    """The base document made unique to ``tag``, so a test gets a pool nobody has built before."""
    return f"{BASE_DOCUMENT}\nFile reference: {tag}."


def inputs(name: str, tag: str, roles: list[str]) -> dict[str, Any]:
    extra = {"question": QUESTION} if name == "role_swarm" else {}
    return {"document": document(tag), "roles": roles, **extra}


@dataclass
class Run:
    """One checkpointed run of a graph and what it measured."""

    name: str
    roles: list[str]
    graph: Any
    checkpointer: InMemorySaver
    config: dict
    result: dict
    builds: int
    seconds: float

    @property
    def handle(self) -> PoolHandle:
        return PoolHandle.model_validate(self.result["pool"])

    @property
    def records(self) -> list[dict]:
        return self.result[RECORDS[self.name]]


def run_graph(name: str, roles: list[str], tag: str) -> Run:
    checkpointer = InMemorySaver()
    graph = GRAPHS[name].build_graph(max_tokens=MAX_TOKENS, checkpointer=checkpointer)
    config = {"configurable": {"thread_id": tag}}
    builds_before = default_engine().pools.build_count
    started = time.perf_counter()
    result = graph.invoke(inputs(name, tag, roles), config)
    seconds = time.perf_counter() - started
    return Run(
        name, roles, graph, checkpointer, config, result, default_engine().pools.build_count - builds_before, seconds
    )


@pytest.fixture(scope="module")
def runs(smollm) -> Iterator[Any]:
    """``runs(name, n)``: the run of graph ``name`` with 3 or 15 roles, made once and shared by the tests."""
    done: dict[tuple[str, int], Run] = {}

    def get(name: str, n: int) -> Run:
        if (name, n) not in done:
            roles = (ROLES_3 if n == 3 else ROLES_15)[name]
            done[name, n] = run_graph(name, roles, tag=f"{name}-{n}-roles")
        return done[name, n]

    yield get
    for (name, n), run in sorted(done.items()):
        print(f"\n{name} with {n} roles: {run.seconds:.1f} s, pool {run.handle.num_tokens} tokens, builds {run.builds}")


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``value`` (containers, pydantic models, message fields)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, BaseModel):  # not dict(value): a model with a `keys` field looks like a mapping
        value = {name: getattr(value, name) for name in type(value).model_fields}
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, list | tuple | set):
        return [t for v in value for t in tensors_in(v)]
    return []


# ---------------------------------------------------------------- one pool, read by every role


@pytest.mark.parametrize("n_roles", [3, 15])
@pytest.mark.parametrize("name", ["document_review", "role_swarm"])
def test_pool_is_built_once_and_every_role_reads_all_of_it(runs, name, n_roles):
    run = runs(name, n_roles)
    handle = run.handle

    assert isinstance(handle, PoolHandle)
    assert run.builds == 1
    assert default_engine().pools.builds_by_digest[handle.digest] == 1
    assert handle.num_tokens > 50  # the whole chat-templated document

    assert len(run.records) == n_roles
    assert sorted(r["role"] for r in run.records) == sorted(run.roles)
    for record in run.records:
        assert record["cache_read"] >= handle.num_tokens, record
        assert record["pool_digest"] == handle.digest
        assert isinstance(record["text"], str)

    # Every call of the run, fixed stages included, read the pool: one AIMessage each, named by its role.
    messages = run.result["messages"]
    assert sorted(m.name for m in messages) == sorted(run.roles + FIXED_STAGES[name])
    assert all(isinstance(m, AIMessage) and pool_read(m) == handle.num_tokens for m in messages)
    if name == "document_review":  # the summarizer continues the critic's conversation: it reads that too
        (critic,) = [m for m in messages if m.name == "critic"]
        (summarizer,) = [m for m in messages if m.name == "summarizer"]
        assert reused(summarizer) >= critic.usage_metadata["input_tokens"] - handle.num_tokens
    assert {m.response_metadata["pool_digest"] for m in messages} == {handle.digest}
    assert isinstance(run.result[FINAL[name]], str)
    if name == "document_review":
        assert all(isinstance(run.result[key], str) for key in ("critique", "summary"))


@pytest.mark.parametrize("n_roles", [3, 15])
def test_the_review_plan_is_typed_and_drives_the_fan_out(runs, n_roles):
    """The planner answers under the plan's grammar: one bounded focus per role, in role order, and each
    specialist was asked about its own entry (its prompt holds that focus, nothing parsed from free text)."""
    run = runs("document_review", n_roles)
    plan = run.result["plan"]
    assert [entry["role"] for entry in plan] == run.roles
    assert all(1 <= len(entry["focus"]) <= document_review.PLAN_FOCUS_CHARS for entry in plan)
    sends = document_review.assign_specialists(run.result)
    assert [(send.arg["role"], send.arg["focus"]) for send in sends] == [(e["role"], e["focus"]) for e in plan]


@pytest.mark.parametrize("name", ["document_review", "role_swarm"])
def test_checkpoint_holds_the_pool_handle_and_no_tensors(runs, name):
    run = runs(name, 3)
    snapshot = run.graph.get_state(run.config)
    assert snapshot.next == ()
    assert PoolHandle.model_validate(snapshot.values["pool"]) == run.handle
    assert tensors_in(snapshot.values) == []

    checkpoint = run.checkpointer.get_tuple(run.config).checkpoint
    _, payload = run.checkpointer.serde.dumps_typed(checkpoint)
    assert len(payload) < 2**20  # a few KiB of text and a handle ...
    assert len(payload) < run.handle.nbytes / 10  # ... never the pool's tensors


@pytest.mark.parametrize("name", ["document_review", "role_swarm"])
def test_second_run_over_the_same_document_reuses_the_pool(runs, name):
    first = runs(name, 3)
    graph = GRAPHS[name].build_graph(max_tokens=MAX_TOKENS)  # another graph, no checkpointer, other roles
    builds_before = default_engine().pools.build_count
    result = graph.invoke(inputs(name, f"{name}-3-roles", roles=first.roles[:1]))
    assert default_engine().pools.build_count == builds_before
    assert result["pool"] == first.handle.to_state()
    assert default_engine().pools.builds_by_digest[first.handle.digest] == 1
    assert result[RECORDS[name]][0]["cache_read"] >= first.handle.num_tokens


# ---------------------------------------------------------------- parallel branches


@pytest.mark.parametrize("name", ["document_review", "role_swarm"])
def test_fifteen_parallel_branches_equal_their_sequential_greedy_calls(runs, name):
    run = runs(name, 15)
    chat = ChatPolyKV(max_tokens=MAX_TOKENS).with_pool(run.handle)
    focus = {entry["role"]: entry["focus"] for entry in run.result.get("plan", [])}
    for record in run.records:
        if name == "role_swarm":
            messages = role_swarm.role_messages(record["role"], QUESTION)
        else:
            messages = document_review.specialist_messages(record["role"], focus[record["role"]])
        sequential = chat.invoke(messages)
        assert sequential.text == record["text"], record["role"]
        assert pool_read(sequential) == run.handle.num_tokens


def test_stream_messages_yields_tokens_from_each_parallel_role(runs):
    first = runs("role_swarm", 3)  # same document: the stream reuses its pool
    graph = role_swarm.build_graph(max_tokens=MAX_TOKENS)
    streamed: dict[str, str] = {}
    namespaces: set[str] = set()
    for chunk, metadata in graph.stream(
        inputs("role_swarm", "role_swarm-3-roles", first.roles), stream_mode="messages"
    ):
        assert isinstance(chunk, AIMessageChunk)
        if metadata["langgraph_node"] == "role_answer":
            namespaces.add(metadata["langgraph_checkpoint_ns"])
        label = f"{metadata['langgraph_node']}/{metadata['agent_role']}"
        streamed[label] = streamed.get(label, "") + chunk.text

    assert set(streamed) == {f"role_answer/{role}" for role in first.roles} | {"aggregate/aggregator"}
    assert len(namespaces) == len(first.roles)  # one task per parallel branch
    # Greedy decoding: the streamed tokens of each branch add up to the answer the checkpointed run recorded.
    for record in first.records:
        assert streamed[f"role_answer/{record['role']}"] == record["text"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", ["document_review", "role_swarm"])
@pytest.mark.parametrize(
    ("roles", "match"),
    [
        ([], r"roles is empty; pass 1 to 15 role names"),
        ([f"role{i}" for i in range(16)], r"16 roles given, but at most 15 roles read one pool in parallel"),
        (["legal", "legal"], r"\['legal'\] are given more than once"),
        (["legal", " "], r"blank name"),
    ],
)
def test_bad_role_lists_are_refused_before_any_prefill(name, roles, match):
    graph = GRAPHS[name].build_graph(max_tokens=MAX_TOKENS)
    builds_before = default_engine().pools.build_count
    with pytest.raises(ValueError, match=match):
        graph.invoke(inputs(name, "bad-roles", roles))
    assert default_engine().pools.build_count == builds_before


def test_role_swarm_refuses_a_blank_question():
    with pytest.raises(ValueError, match=r"state\['question'\] must be non-empty text"):
        role_swarm.build_graph().invoke({"document": BASE_DOCUMENT, "question": "  "})


def test_role_node_before_the_prefetch_node_is_a_clear_error(smollm):
    prefetch = PrefetchDocument(ChatPolyKV(max_tokens=MAX_TOKENS))
    with pytest.raises(ValueError, match=r"a role node ran before the prefetch node"):
        prefetch.pooled_chat({"document": BASE_DOCUMENT})

    def critic(state: document_review.State) -> dict:
        prefetch.pooled_chat(state).invoke([HumanMessage("Anything weak?")])
        return {}

    builder = StateGraph(document_review.State)
    builder.add_node("critic", critic)
    builder.add_edge(START, "critic")  # no prefetch node on the way
    with pytest.raises(ValueError, match=r"Add an edge from the prefetch node to every role node"):
        builder.compile().invoke({"document": BASE_DOCUMENT})


def test_unknown_pool_is_not_found_without_a_document(runs):
    known = runs("role_swarm", 3).handle
    unknown = known.model_copy(update={"digest": "0" * 64})
    messages = [SystemMessage("You are the critic."), HumanMessage("Anything weak?")]
    with pytest.raises(PoolNotFoundError, match=r"run the prefetch node \(which builds the pool\) first"):
        ChatPolyKV(max_tokens=MAX_TOKENS).with_pool(unknown).invoke(messages)
    # With a document that is not the pool's, the rebuild is refused instead of answering from another text.
    other = [{"role": "user", "content": "Another text."}]
    with pytest.raises(ValueError, match=r"is not the one it was built from"):
        ChatPolyKV(max_tokens=MAX_TOKENS).with_pool(unknown, document=other).invoke(messages)
    assert "0" * 64 not in default_engine().pools.builds_by_digest


def test_importing_the_graph_modules_loads_no_model():
    # A fresh interpreter: importing builds both exported graphs, which must not load weights (chat models
    # load on their first call), so `langgraph dev` starts quickly.
    code = (
        "import graphs.document_review, graphs.role_swarm, graphs.document_agent; "
        "from polykv_agents import default_engine; "
        "assert len(default_engine().models) == 0, default_engine().models; "
        "print(graphs.document_review.graph.name, graphs.role_swarm.graph.name, graphs.document_agent.graph.name)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["document_review", "role_swarm", "document_agent"]


# ---------------------------------------------------------------- examples


def example(name: str) -> Callable[..., Any]:
    namespace = runpy.run_path(str(ROOT / "examples" / f"{name}.py"), run_name=f"example_{name}")
    return namespace["main"]


def test_example_document_review(smollm, capsys):
    state = example("document_review")(document(tag="example-review"), roles=["legal", "risk"], max_tokens=4)
    out = capsys.readouterr().out
    assert "[plan]" in out and "[legal] (cache_read=" in out and "[summary]" in out
    assert "pools built in this run: 1" in out
    assert len(state["findings"]) == 2


def test_example_react_agent(smollm, capsys):
    """The ReAct-style agent on SmolLM2: it looks the question up (ToolFirstMiddleware), the call parses and runs,
    and every model call of the loop reads the document from the one pool the run built."""
    state = example("react_agent")(document=document("example-agent"), max_tokens=48)
    out = capsys.readouterr().out
    assert "[model] calls search_document(" in out or "[model] calls percent_change(" in out
    assert "pools built in this run: 1" in out
    calls = [m for m in state["messages"] if isinstance(m, AIMessage) and m.usage_metadata]
    assert calls[0].tool_calls and len(calls) <= 4
    assert {pool_read(m) for m in calls} == {state["pool"]["num_tokens"]}
    assert any(m.type == "tool" and m.tool_call_id == calls[0].tool_calls[0]["id"] for m in state["messages"])


def test_example_stream_parallel_nodes(smollm, capsys):
    streamed = example("stream_parallel_nodes")(
        roles=["analyst", "skeptic", "economist"], max_tokens=4, document=document("example-stream")
    )
    assert {label for label in streamed if label.startswith("role_answer/")} == {
        "role_answer/analyst",
        "role_answer/skeptic",
        "role_answer/economist",
    }
    assert "[role_answer/skeptic]" in capsys.readouterr().out


def test_example_async_roles(smollm, capsys):
    builds_before = default_engine().pools.build_count
    out = example("async_roles")(roles=["analyst", "skeptic"], max_tokens=4, document=document("example-async"))
    assert default_engine().pools.build_count - builds_before == 1  # abatch built it, ainvoke reused it
    assert set(out["batch"]) == {"analyst", "skeptic"}
    # The graph's branches ran the same greedy calls as the batch: same texts.
    assert {a["role"]: a["text"] for a in out["graph"]["answers"]} == out["batch"]
    assert "pools built: 1" in capsys.readouterr().out


def test_the_end_to_end_benchmark_does_equal_work_and_counts_it_from_the_run(smollm):
    from benchmarks.studies.graph_e2e import STAGES, graphs_under_test, run_graph

    roles = ["legal", "finance", "risk"]
    graphs = graphs_under_test(document_review, max_tokens=4)
    runs = {}
    for method, (graph, engine) in graphs.items():
        runs[method], calls = run_graph(graph, engine, document("e2e"), roles)
        assert [c.node for c in calls][:1] == ["planner"] and [c.node for c in calls][-2:] == ["critic", "summarizer"]
    pooled, reprefill = runs["pooled"], runs["reprefill"]
    for run in (pooled, reprefill):
        assert set(run.stage_s) == set(STAGES) and all(seconds >= 0 for seconds in run.stage_s.values())
        assert sum(run.stage_s.values()) <= run.wall_s
        assert {stage: s.calls for stage, s in run.stages.items()} == {
            "planner": 1, "specialist": 3, "critic": 1, "summarizer": 1,
        }  # fmt: skip
        for stage in ("specialist", "critic", "summarizer"):  # EOS ignored: exactly max_tokens per answer
            assert run.stages[stage].output_tokens == 4 * run.stages[stage].calls
    # The same prompts, token for token, read from the pool or prefilled again.
    assert pooled.plan == reprefill.plan
    assert pooled.stages["specialist"].input_tokens == reprefill.stages["specialist"].input_tokens
    assert pooled.stages["specialist"].pool_tokens > 0 and reprefill.stages["specialist"].pool_tokens == 0
