"""``python -m benchmarks <suite>``: every suite, the package's and the repository's studies
(:mod:`benchmarks.registry`), one command each with the options ``polykv-agents bench`` gives the package's; and
``python -m benchmarks plan``, the runs behind the committed results, which ``benchmarks/run_all.sh`` runs.
"""

from __future__ import annotations

import typer

from benchmarks.registry import SUITES
from polykv_agents.cli.bench import add_suite_commands

app = typer.Typer(
    help="Every benchmark: the package's suites and the repository's studies (measured, with warm-up and medians).",
    no_args_is_help=True,
)
add_suite_commands(app, SUITES, "python -m benchmarks")

if __name__ == "__main__":
    app(prog_name="python -m benchmarks")
