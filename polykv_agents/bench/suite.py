"""The one shape every benchmark has: a :class:`Suite`.

Data flow: ``polykv-agents bench <name>`` (or, for the repository's studies, ``python -m benchmarks <name>``)
parses the suite's :attr:`Suite.options` (a pydantic model, one CLI option per field) -> :meth:`Suite.run`
measures and returns a result (a pydantic model) -> :meth:`Suite.write` stores it as JSON next to its Markdown
and plots in ``benchmarks/results/``. Later, ``python benchmarks/render_results.py`` calls :meth:`Suite.render`
on every suite of ``benchmarks/registry.py`` (the package's and the studies): it reads the committed JSON only,
never measures, rewrites the suite's Markdown and plots, and returns what the docs include: a section of
docs/RESULTS.md and named Markdown blocks that fill ``<!-- BEGIN generated: NAME -->`` sections of other docs.

:class:`JsonSuite` is the base of a suite whose result is one JSON file, with an optional Markdown table;
:class:`TableSuite` is the suite for a :class:`~polykv_agents.bench.output.SuiteResult` whose Markdown and
plots are written by one function beside its suite (memory, speed, quality, ...).
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from polykv_agents.bench.output import Progress, SuiteResult
from polykv_agents.bench.provenance import Provenance

if TYPE_CHECKING:
    from polykv_agents.model.weights import WeightsChoice


class SuiteOptions(BaseModel):
    """Base of every suite's options: frozen, validated, each field's docstring is its CLI help.

    A field's CLI flag is ``--field-name``, or ``Field(json_schema_extra={"flag": "--other"})``; a list
    field is a repeatable option.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


@dataclass(frozen=True)
class Rendered:
    """What a suite contributes to the docs, rendered from its committed JSON."""

    results: Sequence[str] = ()
    """Lines of its section of docs/RESULTS.md (none: the suite has no section there)."""
    blocks: dict[str, str] = field(default_factory=dict)
    """Markdown for each ``<!-- BEGIN generated: NAME -->`` section of the other docs, by NAME."""
    provenance: Sequence[Provenance] = ()
    """Which code produced each run rendered (the renderer marks the section stale when that code changed)."""
    parts: Mapping[str, Sequence[Provenance]] = field(default_factory=dict)
    """Runs behind some rows only, by part (``{"peers": [...]}``: rows borrowed from an earlier run), each checked
    against that part's own sources (``"<suite>.<part>"`` in the repository's staleness registry)."""


def provenance_in(result: BaseModel) -> list[Provenance]:
    """The :class:`Provenance` records among ``result``'s fields (its ``info``, ``run_info`` or ``provenance``)."""
    return [value for value in vars(result).values() if isinstance(value, Provenance)]


OptionsT = TypeVar("OptionsT", bound=SuiteOptions)
ResultT = TypeVar("ResultT", bound=BaseModel)


class Suite(Protocol):
    """A benchmark: its name, its options, how it measures, how its result is written and rendered."""

    name: str
    """``polykv-agents bench <name>`` (a study: ``python -m benchmarks <name>``); also the stem of its files in the
    results folder."""
    summary: str
    """What it measures, in one line (the command's ``--help``)."""
    options: type[SuiteOptions]
    """Its settings; the CLI makes one option of each field."""
    reproduce: Sequence[Sequence[str]]
    """The CLI arguments of each run behind the committed results (``benchmarks/run_all.sh`` runs them)."""

    def run(self, options: Any, progress: Progress) -> BaseModel:
        """Measure (load the model, warm up, repeat, take medians) and return everything measured."""
        ...

    def write(self, result: Any, out_dir: Path) -> list[Path]:
        """Write the result's JSON, and its Markdown and plots where it has them; return the paths."""
        ...

    def render(self, results_dir: Path) -> Rendered | None:
        """From the JSON in ``results_dir`` alone, rewrite the Markdown and plots and return what the docs
        include; ``None`` when the suite has not run."""
        ...


def load_model_for(model: str | None, weights: WeightsChoice = "native"):
    """``(model, tokenizer)``: the embedded model, or the local/cached one named by ``--model``, its weights stored
    as ``weights``."""
    from polykv_agents.engine import load_model

    return load_model(model, weights=weights)


def document_text(path: Path | None, chars: int = 60_000) -> str:
    """The text of ``--document``, or the first ``chars`` characters of CPython's ``pydoc_data.topics``."""
    if path is None:
        from polykv_agents.eval.corpus import pydoc_documents

        return pydoc_documents(1, chars_per_document=chars)[0]
    from polykv_agents.pool.documents import document_text as decode

    return decode(path.read_bytes())


def results_section(markdown: str, command: str) -> list[str]:
    """A suite's Markdown as a section of docs/RESULTS.md: its heading one level up, the command that
    produced it under the heading, and its images relative to docs/."""
    markdown = re.sub(r"\]\(([\w.-]+\.png)\)", r"](../benchmarks/results/\1)", markdown)
    heading, body = markdown.replace("### ", "## ", 1).split("\n", 1)
    return [heading, "", f"Produced by `{command}`.", body]


@dataclass(frozen=True)
class TableSuite(Generic[OptionsT]):
    """A suite whose result is a :class:`SuiteResult`, written by its ``writer`` (its table, notes and plots)."""

    name: str
    summary: str
    options: type[OptionsT]
    measure: Callable[[OptionsT, Progress], SuiteResult]
    """Runs the suite with its options, calling the progress callback once per step."""
    writer: Callable[[SuiteResult, Path], list[Path]]
    """Writes the JSON, the Markdown and the plots (:func:`~polykv_agents.bench.output.write_suite`)."""
    command: str = ""
    """The command docs/RESULTS.md names; default ``polykv-agents bench <name>``."""
    reproduce: Sequence[Sequence[str]] = ((),)
    blocks: Callable[[SuiteResult], dict[str, str]] | None = None
    """Markdown for ``<!-- BEGIN generated: NAME -->`` sections of other docs, by NAME (none by default)."""

    def run(self, options: OptionsT, progress: Progress) -> SuiteResult:
        # The writer's plots need the bench extras (matplotlib), whose absence the CLI reports before anything
        # is measured, not after.
        importlib.import_module("polykv_agents.bench.plots")
        return self.measure(options, progress)

    def write(self, result: SuiteResult, out_dir: Path) -> list[Path]:
        return self.writer(result, out_dir)

    def render(self, results_dir: Path) -> Rendered | None:
        """The embedded model's results, then each other model's (``--out benchmarks/results/<model>``: a folder
        of its own), each a section of docs/RESULTS.md; the blocks come from the embedded model's."""
        path = results_dir / f"{self.name}.json"
        if not path.exists():
            return None
        result = SuiteResult.load(path)
        self.write(result, results_dir)  # a new presentation needs no new measurement
        markdown = (results_dir / f"{self.name}.md").read_text()
        command = self.command or f"polykv-agents bench {self.name}"
        sections = results_section(markdown, command)
        runs = [result.info]
        for other in sorted(results_dir.glob(f"*/{self.name}.json")):
            their = SuiteResult.load(other)
            self.write(their, other.parent)
            own = [a for a in self.reproduce if a and a[-1].endswith(f"/{other.parent.name}")]  # its planned run
            ran = f"polykv-agents bench {self.name} {shlex.join(own[0])}" if own else command
            heading, *body = results_section((other.parent / f"{self.name}.md").read_text(), ran)
            here = f"](../benchmarks/results/{other.parent.name}/"  # its plots are in its own folder
            body = [line.replace("](../benchmarks/results/", here) for line in body]
            sections += ["", f"{heading}, {their.info.model}", *body]
            runs.append(their.info)
        blocks = self.blocks(result) if self.blocks is not None else {}
        return Rendered(results=sections, blocks=blocks, provenance=runs)


class JsonSuite(Generic[ResultT]):
    """A suite whose result is one pydantic model stored as ``<name>.json``, with an optional Markdown table
    ``<name>.md``. Subclasses set ``name``, ``summary``, ``options``, ``reproduce`` and ``result_type``, and
    implement ``run``, :meth:`markdown` (if they have a table) and :meth:`rendered`."""

    name: str
    result_type: type[ResultT]

    def markdown(self, result: ResultT) -> str | None:
        """The suite's Markdown table (``None``: it has none)."""
        return None

    def rendered(self, result: ResultT) -> Rendered:
        """What the docs include from ``result``."""
        raise NotImplementedError

    def write(self, result: ResultT, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.name}.json"
        path.write_text(json.dumps(result.model_dump(), indent=1), encoding="utf-8")
        return [path, *self._write_markdown(result, out_dir)]

    def render(self, results_dir: Path) -> Rendered | None:
        path = results_dir / f"{self.name}.json"
        if not path.exists():
            return None
        result = self.result_type.model_validate_json(path.read_text())
        self._write_markdown(result, results_dir)  # a new presentation needs no new measurement
        return replace(self.rendered(result), provenance=provenance_in(result))

    def _write_markdown(self, result: ResultT, out_dir: Path) -> list[Path]:
        markdown = self.markdown(result)
        if markdown is None:
            return []
        path = out_dir / f"{self.name}.md"
        path.write_text(markdown, encoding="utf-8")
        return [path]
