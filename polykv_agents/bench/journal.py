"""A run's journal: results appended item by item to a JSON Lines file, so a long run that stops continues.

``bench tasks`` at 7K tokens answers for about 6 hours on 2 cores. With ``--journal FILE`` each item's answers
are appended (and flushed) as soon as they exist; a later run given the same file and the same options reads
them back and answers only the items still missing. The first line records the options: a journal written by
a run with other options (another seed, model, config list...) is refused, because its answers would not be
the ones asked for. Options that only say how far a run goes (``extent``: which contexts, how many items) may
differ, since each record's key names its item: a run that adds a context continues the same journal.

  line 1:  {"journal": <suite name>, "options": {...}}
  line k:  {"key": <item key>, "records": [...]}      one per finished item

A last line cut short (the process killed while writing it) is dropped when the journal is opened again.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any


class JournalMismatchError(ValueError):
    """The journal was written by a run with other options."""


class Journal:
    """Append-only records by item key, in a JSON Lines file; see the module doc."""

    def __init__(self, path: Path, suite: str, options: dict[str, Any], extent: Collection[str] = ()) -> None:
        self.path = Path(path)
        header = {"journal": suite, "options": options}
        self.done: dict[str, list[Any]] = {}
        if self.path.is_file() and self.path.stat().st_size:
            self._read(header, set(extent))
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(_line(header), encoding="utf-8")

    def _read(self, header: dict[str, Any], extent: set[str]) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        written, expected = json.loads(lines[0]), json.loads(_line(header))  # as JSON: tuples and lists alike
        old, new = written.get("options", {}), expected["options"]
        changed = differing_options(old, new, extent)
        if written.get("journal") != expected["journal"] or changed:
            msg = (
                f"{self.path} is the journal of another run (its {written.get('journal')!r} options differ in: "
                f"{', '.join(changed) or 'the suite'}); give this run another --journal file, or delete that one"
            )
            raise JournalMismatchError(msg)
        kept = [lines[0]]
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break  # the line being written when the run stopped; everything before it is whole
            if not line.endswith("\n"):
                break
            self.done[entry["key"]] = entry["records"]
            kept.append(line)
        if len(kept) < len(lines):
            self.path.write_text("".join(kept), encoding="utf-8")

    def append(self, key: str, records: list[Any]) -> None:
        """Record ``key``'s finished records, on disk before this returns."""
        with self.path.open("a", encoding="utf-8") as file:  # closed, so written through, before returning
            file.write(_line({"key": key, "records": records}))
        self.done[key] = records


def differing_options(old: dict[str, Any], new: dict[str, Any], extent: Collection[str] = ()) -> list[str]:
    """The option names whose values differ between two runs (sorted), those in ``extent`` left out."""
    return sorted(key for key in (old.keys() | new.keys()) - set(extent) if old.get(key) != new.get(key))


def _line(entry: dict[str, Any]) -> str:
    return json.dumps(entry, sort_keys=True) + "\n"
