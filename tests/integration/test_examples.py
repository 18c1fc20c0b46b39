"""The examples run end to end on the embedded model."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_quickstart_streams_three_answers(smollm, capsys):
    main = runpy.run_path(str(EXAMPLES / "quickstart.py"))["main"]
    answers = main(max_new_tokens=4)
    assert set(answers) == {"planner", "critic", "summarizer"}
    assert all(answers.values())
    assert "shared pool" in capsys.readouterr().out


def test_two_documents_compose_their_pools_and_answer(smollm, capsys):
    main = runpy.run_path(str(EXAMPLES / "two_documents.py"))["main"]
    answer = main(max_new_tokens=8)
    assert answer.strip()
    out = capsys.readouterr().out
    assert "composed [" in out and "'recompute': 0.05" in out
