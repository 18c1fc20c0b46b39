"""Bad input to the `polykv-agents` command line: a clean error and exit code, never a raw traceback.

Document checks run before any model is loaded, and the tests that need a model pass the tiny
checkpoint with ``--model``, so none of them loads the embedded SmolLM2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from polykv_agents.cli import support as cli_support
from polykv_agents.cli.main import app

runner = CliRunner()

COMMANDS = {"demo": ["demo"], "eval-ppl": ["eval", "ppl"]}


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text("Shared caches let many agents read one document. " * 20, encoding="utf-8")
    return path


def words(text: str) -> str:
    """The text's words joined by single spaces: rich and typer wrap long lines (typer inside a box)."""
    return " ".join(text.translate(str.maketrans("", "", "│╭╮╰╯─")).split())


def assert_clean_error(result, fragment: str, *, exit_code: int = 1) -> None:
    """The command exited on its own (SystemExit), with the expected code and message on stderr."""
    assert isinstance(result.exception, SystemExit), f"raw exception: {result.exception!r}"
    assert result.exit_code == exit_code, result.output
    assert fragment in words(result.stderr)
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_missing_document_file_is_a_usage_error(command, tmp_path):
    result = runner.invoke(app, [*command, "--document", str(tmp_path / "missing.txt")])
    assert_clean_error(result, "does not exist", exit_code=2)


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_directory_as_document_is_a_usage_error(command, tmp_path):
    result = runner.invoke(app, [*command, "--document", str(tmp_path)])
    assert_clean_error(result, "is a directory", exit_code=2)


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_non_utf8_document_is_a_clean_error(command, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9.".encode("latin-1"))
    result = runner.invoke(app, [*command, "--document", str(path)])
    assert_clean_error(result, "error: the document is not valid UTF-8")


def test_an_empty_document_is_a_clean_error_for_eval_ppl(tmp_path):
    """test_cli covers `demo`; `eval ppl` reads the document through the same check."""
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    result = runner.invoke(app, ["eval", "ppl", "--document", str(path)])
    assert_clean_error(result, "the document is empty or only whitespace")


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_missing_model_is_a_clean_error(command, text_file, tmp_path):
    result = runner.invoke(app, [*command, "--document", str(text_file), "--model", str(tmp_path / "no-model")])
    assert_clean_error(result, "nothing is downloaded at run time. Pass a local directory")


def test_a_document_longer_than_the_model_is_a_clean_error(tiny_model_dir, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("q" * 1500, encoding="utf-8")  # 1500 tokens; the tiny Llama has 1024 positions
    result = runner.invoke(app, ["demo", "--document", str(path), "--model", tiny_model_dir])
    assert_clean_error(result, "covers at most 1024 positions")
    assert "shorten or split the document" in words(result.stderr)


def test_eval_ppl_past_the_models_positions_is_a_clean_error(tiny_model_dir, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("q" * 1200, encoding="utf-8")
    lengths = ["--context-tokens", "1000", "--continuation-tokens", "100"]  # 1100 > 1024 positions
    result = runner.invoke(app, ["eval", "ppl", "--document", str(path), "--model", tiny_model_dir, *lengths])
    assert_clean_error(result, "positions")


def test_an_unreadable_document_is_a_clean_error(text_file, monkeypatch):
    original_read_bytes = Path.read_bytes

    def read_bytes(self):
        if self == text_file:  # as for a file without read permission (tests may run as root)
            raise PermissionError(13, "Permission denied", str(self))
        return original_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    result = runner.invoke(app, ["eval", "ppl", "--document", str(text_file)])
    assert_clean_error(result, "Permission denied")


def test_an_error_is_one_line_however_long(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_support.err, "_width", 80)  # what rich uses when stderr is a pipe
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9 " * 10)
    result = runner.invoke(app, ["eval", "ppl", "--document", str(path)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the document is not valid UTF-8")
