"""Where a suite's results go: ``<out>/<suite>.json`` (everything measured), ``<out>/<suite>.md`` (a
table that states its conditions) and ``<out>/<suite>_<plot>.png``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel

from polykv_agents.bench.environment import RunInfo

Progress = Callable[[str], None]
"""What a suite calls once per step with the step's description (the CLI's progress bar)."""


class Column(NamedTuple):
    """One table column: its header, and how to render it from a row."""

    header: str
    render: Callable[[dict[str, Any]], str]


def column(header: str, key: str, fmt: str = "{}") -> Column:
    """A column showing ``row[key]`` formatted with ``fmt``."""
    return Column(header, lambda row: fmt.format(row[key]))


MIB = 2**20


def mib_column(header: str, key: str, digits: int = 1) -> Column:
    """A column showing the byte count ``row[key]`` in MiB."""
    return Column(header, lambda row: f"{row[key] / MIB:,.{digits}f}")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.render(row) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class SuiteResult(BaseModel):
    """One suite run: its conditions, one row per measurement, and derived conclusions."""

    suite: str
    info: RunInfo
    settings: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: dict[str, Any] = {}

    @classmethod
    def load(cls, path: Path) -> SuiteResult:
        return cls.model_validate_json(path.read_text(encoding="utf-8"))


def write_suite(
    result: SuiteResult,
    out_dir: Path,
    *,
    title: str,
    columns: Sequence[Column],
    figures: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
    table_rows: Sequence[dict[str, Any]] | None = None,
) -> list[Path]:
    """Write the JSON (every row), the Markdown table (``table_rows``, default every row) and the plots
    (matplotlib figures, closed once saved)."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{result.suite}.json"]
    written[0].write_text(result.model_dump_json(indent=1), encoding="utf-8")
    images = []
    for name, figure in (figures or {}).items():
        path = out_dir / f"{result.suite}_{name}.png"
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
        images.append(path)
    settings = ", ".join(f"{k}={v}" for k, v in result.settings.items())
    parts = [
        f"### {title}",
        f"Measured on {result.info.sentence()}; {result.info.date}. {result.info.commit_sentence()} "
        f"Settings: {settings}.",
        markdown_table(result.rows if table_rows is None else table_rows, columns),
        *notes,
        *(f"![{p.stem}]({p.name})" for p in images),
    ]
    markdown = out_dir / f"{result.suite}.md"
    markdown.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    written += [markdown, *images]
    return written
