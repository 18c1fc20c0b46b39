"""``polykv-agents bench <suite>``: one command per registered suite (:mod:`polykv_agents.bench.registry`),
its options made from the suite's options model. Each writes its JSON, Markdown and plots to ``--out``;
``python benchmarks/render_results.py`` then regenerates docs/RESULTS.md and the docs' generated sections.

``polykv-agents bench plan`` prints the runs behind the committed results. :func:`add_suite_commands` mounts
the same commands on any typer app: the repository's ``python -m benchmarks`` mounts every suite, its studies
with the package's (``benchmarks/run_all.sh`` runs its plan).
"""

from __future__ import annotations

import functools
import inspect
import operator
import shlex
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Union

import typer
from pydantic.fields import FieldInfo
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from polykv_agents.bench.provenance import Provenance
from polykv_agents.bench.registry import SUITES
from polykv_agents.bench.suite import Suite
from polykv_agents.cli.support import clean_errors, err, out

bench_app = typer.Typer(help="Benchmarks (measured, with warm-up and medians).", no_args_is_help=True)

DEFAULT_OUT = Path("benchmarks/results")
OutOpt = Annotated[Path, typer.Option("--out", file_okay=False, help="Folder for the JSON, Markdown and PNG files.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object on stdout.")]


@contextmanager
def _steps() -> Iterator[Callable[[str], None]]:
    """A spinner that shows the suite's current step and how many it has done."""
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TextColumn("step {task.completed}"),
        TimeElapsedColumn(), console=err, transient=True,
    ) as progress:  # fmt: skip
        task = progress.add_task("starting", total=None)

        def step(description: str) -> None:
            progress.update(task, description=description, advance=1)

        yield step


def _cli_type(annotation: Any) -> Any:
    """The type typer parses: pydantic's constrained types (``FilePath``) become their base type; the
    options model validates the value again."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _cli_type(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return functools.reduce(operator.or_, (_cli_type(a) for a in typing.get_args(annotation)))
    if origin is list:  # a repeatable option: typer parses lists of plain types only
        return list[_cli_type(typing.get_args(annotation)[0])]
    return annotation


def _option(name: str, field: FieldInfo) -> inspect.Parameter:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    flag = str(extra.get("flag", "--" + name.replace("_", "-")))
    cli_type = _cli_type(field.annotation)
    if cli_type is bool:  # a switch either way: one that defaults to on must be able to go off
        flag = f"{flag}/--no-{flag.removeprefix('--')}"
    annotation = Annotated[cli_type, typer.Option(flag, help=field.description)]
    default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=True)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def suite_command(suite: Suite) -> Callable[..., None]:
    """A typer command running ``suite``: its options, then ``--out`` and ``--json``."""
    fields = suite.options.model_fields
    assert not {"out_dir", "as_json"} & fields.keys(), f"{suite.name}: option names reserved by the CLI"

    def command(**kwargs: Any) -> None:
        out_dir, as_json = kwargs.pop("out_dir"), kwargs.pop("as_json")
        options = suite.options(**kwargs)
        with _steps() as step:
            Provenance.of_this_process()  # the code this run imported, before any edit made while it measures
            result = suite.run(options, step)
        written = suite.write(result, out_dir)
        if as_json:
            typer.echo(result.model_dump_json())
        for path in written:
            (err if as_json else out).print(f"wrote {path}")

    parameters = [_option(name, field) for name, field in fields.items()]
    parameters += [
        inspect.Parameter("out_dir", inspect.Parameter.KEYWORD_ONLY, default=DEFAULT_OUT, annotation=OutOpt),
        inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=JsonOpt),
    ]
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    command.__doc__ = suite.summary
    command.__name__ = f"bench_{suite.name}"
    return clean_errors(command)


def add_suite_commands(app: typer.Typer, suites: Mapping[str, Suite], program: str) -> None:
    """Mount one command per suite on ``app``, and ``plan``, which prints each run behind the committed results
    as one ``program`` argument list a line (shell-quoted)."""
    for suite in suites.values():
        app.command(suite.name)(suite_command(suite))

    def plan() -> None:
        for suite in suites.values():
            for arguments in suite.reproduce:
                typer.echo(shlex.join([suite.name, *arguments]))

    plan.__doc__ = f"Print each run behind the committed results, one `{program}` argument list a line."
    app.command("plan")(plan)


add_suite_commands(bench_app, SUITES, "polykv-agents bench")
