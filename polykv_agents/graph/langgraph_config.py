"""A deployment's graphs, loaded by path from its ``langgraph.json`` as ``langgraph dev`` loads them.

The repository's ``graphs/`` sit next to the package, not inside it, so a benchmark that runs a workflow (the
serving benchmark, the repository's studies) finds the file through a ``langgraph.json`` (``--graphs``) instead
of changing ``sys.path``: a user's own deployment is measured the same way.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

LANGGRAPH_JSON = Path("langgraph.json")
"""Default ``--graphs``: the repository's workflow list, relative to the working directory."""


def load_workflow(name: str, config: Path = LANGGRAPH_JSON) -> ModuleType:
    """The module of workflow ``name`` (e.g. ``document_review``) listed in ``config``.

    Raises:
        ValueError: ``config`` cannot be read or does not list ``name``.
    """
    try:
        path = config.parent / json.loads(config.read_text(encoding="utf-8"))["graphs"][name].split(":")[0]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        msg = f"cannot find graph {name!r} in {config}: run where your langgraph.json is, or pass --graphs"
        raise ValueError(msg) from e
    module_name = f"graphs.{path.stem}"  # its import name in the repository, so both ways share one module
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, f"no loader for {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # LangGraph resolves the State's annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
