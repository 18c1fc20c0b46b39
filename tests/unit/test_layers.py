"""The rooms of the package and what each may import (docs/ARCHITECTURE.md draws the same picture).

A room is a subpackage (``pool/``, ``runtime/``, ...) or a top-level module (``engine.py``, ``config.py``).
Lower rooms never import higher ones, so the decode path reads bottom-up and a room can be tested alone.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import polykv_agents

PACKAGE = Path(polykv_agents.__file__).parent

ALLOWED: dict[str, set[str]] = {
    # Compression: configs build codecs, codecs read their configs.
    "config": {"codecs"},
    "codecs": {"config"},
    "model": {"codecs", "kernels"},  # dtype names; the int8 tile kernel
    "sampling": set(),
    "prompting": {"sampling"},  # tool-call grammars
    "pool": {"codecs", "config", "model", "prompting"},
    "kernels": set(),  # native kernels and their build: no other room
    "runtime": {"codecs", "kernels", "model", "pool", "sampling"},  # codecs: attention over the pool as stored
    "engine": {"model", "pool", "runtime"},
    "agent": {"engine", "model", "pool", "prompting", "runtime", "sampling"},
    "chat": {"config", "engine", "model", "pool", "prompting", "runtime", "sampling"},
    "distributed": {"chat", "config", "engine", "model", "pool"},
    "graph": {"chat", "config", "distributed", "engine", "model", "pool", "runtime"},  # model/runtime: setting names
    "eval": {"config", "model", "pool", "sampling"},
    "handle": {"pool"},  # the checkpoints' import path of PoolHandle
    # The suites of a user's own deployment; the studies of chat, graph and Ray runs are the repository's.
    "bench": {"agent", "config", "engine", "eval", "graph", "kernels", "model", "pool", "runtime", "sampling"},
}
"""Room -> rooms it may import. ``cli`` and the package root may import any room."""


def _room(module: str) -> str:
    parts = module.split(".")
    return "(root)" if len(parts) == 1 else parts[1].removesuffix(".py")


def _imports() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> files, for every import of another room."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        source = "(root)" if relative.parts == ("__init__.py",) else relative.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("polykv_agents"):
                target = _room(node.module)
                if target not in (source, "(root)") or (target == "(root)" and source != "(root)"):
                    found.setdefault((source, target), []).append(str(relative))
    return found


def test_every_room_is_listed():
    rooms = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert rooms - {"__init__"} <= set(ALLOWED) | {"cli"}, "a new room needs its line in ALLOWED and ARCHITECTURE.md"


def test_rooms_import_only_rooms_below_them():
    violations = [
        f"{source} -> {target} ({', '.join(files)})"
        for (source, target), files in _imports().items()
        if source not in ("cli", "(root)") and target not in ALLOWED.get(source, set())
    ]
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The test above can fail: a runtime module that imported the chat room would be reported."""
    fake = tmp_path / "polykv_agents"
    (fake / "runtime").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "runtime" / "bad.py").write_text("from polykv_agents.chat.chat_model import ChatPolyKV\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert ("runtime", "chat") in _imports()


def test_the_package_never_imports_the_repository_benchmarks():
    """``benchmarks/`` (the studies, the renderer) is not installed: a wheel that imported it would not load."""
    importing = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "benchmarks")
        or (isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "benchmarks" for alias in node.names))
    ]
    assert not importing, importing
