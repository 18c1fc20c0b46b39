"""What every command line over benchmark suites must offer (``polykv-agents bench`` over the package's suites,
``python -m benchmarks`` over all of them): a command per suite with one option per field of its options, and a
plan whose every run names options its suite has."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

import typer
from typer.testing import CliRunner

from polykv_agents.bench.suite import Suite

runner = CliRunner()


def _flags(suite: Suite) -> set[str]:
    return {
        (f.json_schema_extra or {}).get("flag", "--" + n.replace("_", "-"))  # type: ignore[union-attr]
        for n, f in suite.options.model_fields.items()
    }


def assert_every_suite_is_a_command(app: typer.Typer, prefix: Sequence[str], suites: Mapping[str, Suite]) -> str:
    """Each of ``suites`` is a command of ``app`` (after ``prefix``) with its options, ``--out`` and ``--json``;
    returns the listing of the commands."""
    listed = runner.invoke(app, [*prefix, "--help"], terminal_width=200)
    assert listed.exit_code == 0, listed.output
    for name, suite in suites.items():
        assert f" {name} " in listed.output, name
        # Wide enough for every flag in full: a switch takes two columns (--x and --no-x), and rich reads COLUMNS.
        result = runner.invoke(app, [*prefix, name, "--help"], terminal_width=200, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        missing = [flag for flag in (*_flags(suite), "--out", "--json") if flag not in result.output]
        assert not missing, (name, missing)
    return listed.output


def assert_plan_parses(app: typer.Typer, prefix: Sequence[str], suites: Mapping[str, Suite]) -> None:
    """``plan`` lists a run of every suite that has one, and every planned flag is an option of its suite."""
    result = runner.invoke(app, [*prefix, "plan"])
    assert result.exit_code == 0, result.output
    runs = [shlex.split(line) for line in result.stdout.splitlines()]
    assert {run[0] for run in runs} == {name for name, suite in suites.items() if suite.reproduce}
    for name, *arguments in runs:
        assert {a for a in arguments if a.startswith("--")} <= {*_flags(suites[name]), "--out"}, name
