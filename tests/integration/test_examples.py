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
