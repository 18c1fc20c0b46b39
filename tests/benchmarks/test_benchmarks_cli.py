"""`python -m benchmarks`: every suite, the package's and the repository's studies, in the docs' order, a command
with its options; its plan lists the runs `benchmarks/run_all.sh` makes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from suite_commands import assert_every_suite_is_a_command, assert_plan_parses

from benchmarks.__main__ import app
from benchmarks.registry import SUITES
from polykv_agents.bench.registry import SUITES as PACKAGE_SUITES

ROOT = Path(__file__).resolve().parents[2]


def test_every_suite_is_a_command_with_its_options():
    assert_every_suite_is_a_command(app, [], SUITES)


def test_the_registry_holds_the_package_suites_in_their_order_among_the_studies():
    assert [name for name in SUITES if name in PACKAGE_SUITES] == list(PACKAGE_SUITES)
    assert all(SUITES[name] is suite for name, suite in PACKAGE_SUITES.items())
    assert {"ablation", "frontier", "peers", "graph_e2e", "load_soak"} <= set(SUITES)


def test_plan_lists_every_planned_run_whose_options_parse():
    assert_plan_parses(app, [], SUITES)


def test_it_runs_as_a_module_from_the_repository_root():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "python -m benchmarks" in done.stdout and "ablation" in done.stdout and "memory" in done.stdout
