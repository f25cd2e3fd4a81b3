"""Every command's bad input is one line and exit 2; an unexpected failure is one line naming
the file that holds its traceback, and exit 1 (typer's runner)."""

from __future__ import annotations

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

runner = CliRunner()

BAD_INPUTS = [
    (["train", "--steps", "abc"], "invalid value for '--steps'"),
    (["train", "--frobnicate"], "no such option: --frobnicate"),
    (["train", "--dtype", "fp8"], "dtype 'fp8' is not valid"),
    (["train", "--host-budget", "lots"], "is not a size"),
    (["train", "--resume"], "--resume needs --run-dir"),
    (["plan", "--model", "zzz"], "unknown model preset 'zzz'"),
    (["plan", "--gpus", "0"], "number of GPUs must be an integer >= 1"),
    (["bench", "--path", "/nonexistent/dir"], "does not exist"),
    (["report", "/nonexistent"], "has no metrics.jsonl"),
    (
        ["export", "/nonexistent", "--out", "x.safetensors"],
        "run directory '/nonexistent' does not exist",
    ),
    (["export"], "missing argument"),
    (["inspect", "/nonexistent"], "does not exist"),
    (["frobnicate"], "no such command 'frobnicate'"),
]


@pytest.mark.parametrize("args,fragment", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_sentence_with_a_hint_and_exit_2(
    tmp_path, monkeypatch, args: list[str], fragment: str
) -> None:
    monkeypatch.chdir(tmp_path)  # a run directory a bad flag might create lands here
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (
        result.output
    )
    assert ";" in lines[0]  # the problem, then what to do about it
    assert "Traceback" not in result.output


def test_unexpected_failure_is_one_line_naming_the_traceback_file(tmp_path, monkeypatch) -> None:
    def broken(run_dir):
        raise RuntimeError("the metrics reader broke\nsecond line")

    monkeypatch.setenv("TIERZERO_CRASH_DIR", str(tmp_path / "crashes"))
    monkeypatch.setattr("tierzero.cli.report.load_run", broken)
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert (
        len(lines) == 1
        and "failed unexpectedly (RuntimeError: the metrics reader broke)" in lines[0]
    ), result.output
    [written] = (tmp_path / "crashes").iterdir()
    assert str(written) in lines[0]
    text = written.read_text()
    assert text.startswith("Traceback") and "in broken" in text and "second line" in text
