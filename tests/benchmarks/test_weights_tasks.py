"""The probe pairing a quantized-weights task run with the native one, item by item."""

from __future__ import annotations

import pytest

from benchmarks.probes.weights_tasks import compare
from polykv_agents.bench.tasks import TasksResult

RUN_INFO = {"machine": "Linux x86_64", "cpu": "cpu", "cpu_count": 2, "torch_threads": 2, "device": "cpu",
            "torch": "2.13.0", "transformers": "5.25.0", "python": "3.11", "model": "m", "dtype": "bfloat16",
            "date": "2026-12-07"}  # fmt: skip
OPTIONS = {"contexts": [256], "items": 4, "tasks": ["niah_single"], "configs": ["full", "default"], "seed": 0,
           "model": None, "runtime": "decompressed"}  # fmt: skip


def _run(scores: dict[str, list[float]], **options) -> TasksResult:
    answers = [
        {"context": 256, "item": item, "task": "niah_single", "config": config, "document_tokens": 300,
         "compression_ratio": 1.0, "answer": "", "references": ["x"], "score": score, "f1": score}
        for config, values in scores.items() for item, score in enumerate(values)
    ]  # fmt: skip
    return TasksResult.model_validate({"run_info": RUN_INFO, "options": {**OPTIONS, **options}, "answers": answers})


def test_each_config_is_paired_item_by_item():
    native = _run({"full": [1, 1, 0, 0], "default": [1, 0, 0, 1]})  # a result from before --weights: native
    int8 = _run({"full": [1, 1, 0, 1], "default": [0, 0, 0, 1]}, weights="int8")
    result = compare(native, int8)
    assert result["weights"] == "int8"
    full, default = result["configs"]["full"], result["configs"]["default"]
    assert (full["native_score"], full["quantized_score"]) == (50, 75)
    assert full["same_text"] == 4  # every answer is the empty string here
    assert full["change_points"]["mean"] == 25 and (
        full["change_points"]["better"],
        full["change_points"]["worse"],
    ) == (1, 0)
    assert default["change_points"]["mean"] == -25 and default["change_points"]["worse"] == 1


def test_runs_that_asked_other_questions_are_refused():
    with pytest.raises(ValueError, match="differ in: seed, weights"):
        compare(_run({"full": [1]}), _run({"full": [1]}, weights="int8", seed=1))
    with pytest.raises(ValueError, match="differ in: nothing"):
        compare(_run({"full": [1]}), _run({"full": [1]}))
