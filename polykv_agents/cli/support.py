"""What every ``polykv-agents`` command shares: the consoles, clean errors, progress, loading."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from polykv_agents.model.loading import DEFAULT_MODEL, ModelNotFoundError

out = Console()
err = Console(stderr=True, soft_wrap=True)  # an error stays one line in logs and pipes, whatever its length

F = TypeVar("F", bound=Callable[..., Any])

BENCH_EXTRA_MODULES = {"matplotlib", "scipy", "psutil"}
BENCH_EXTRA_HINT = '; install the benchmark extras: pip install "polykv-agents[bench]"'
PEERS_EXTRA_MODULES = {"llama_cpp", "optimum"}
PEERS_EXTRA_HINT = (
    '; install the peer engines: pip install "polykv-agents[peers]" (builds llama.cpp, about 15 minutes on 2 cores)'
)

ModelOpt = Annotated[str | None, typer.Option("--model", help="Local HF model dir or cached id; default: embedded.")]


def clean_errors(command: F) -> F:
    """Turn expected user errors into one red line and exit code 1 instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, error['loc'])) or 'settings'}: {error['msg'].removeprefix('Value error, ')}"
                for error in e.errors()
            )
            err.print(f"[bold red]error:[/] invalid settings: {escape(problems)}")
        except (ValueError, TypeError, ModelNotFoundError) as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}")
        except ModuleNotFoundError as e:
            root = (e.name or "").split(".")[0]
            hint = BENCH_EXTRA_HINT if root in BENCH_EXTRA_MODULES else ""
            if root in PEERS_EXTRA_MODULES:
                hint = PEERS_EXTRA_HINT
            err.print(f"[bold red]error:[/] {escape(f'{e}{hint}')}")
        except (PermissionError, IsADirectoryError, NotADirectoryError) as e:  # a path that cannot be read
            where = e.filename or "a file"
            err.print(f"[bold red]error:[/] {escape(f'cannot access {where}: {e.strerror or e}')}")
        raise typer.Exit(code=1)

    return wrapper  # type: ignore[return-value]


def progress_bar() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


def load_model_with_spinner(name: str | None):
    from polykv_agents.engine import load_model

    with err.status(f"Loading {name or DEFAULT_MODEL} ..."):
        return load_model(name)


def read_document(path: Path) -> str:
    from polykv_agents.pool.documents import document_text

    return document_text(path.read_bytes())


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"
