"""`tierzero train` through typer's runner on a quick shape, and the one-line-error check the
CLI's refusals share."""

from __future__ import annotations

from tierzero.cli.app import app
from typer.testing import CliRunner, Result

runner = CliRunner()
QUICK = ["--batch-size", "2", "--seq-len", "32"]


def train(*args: str) -> Result:
    return runner.invoke(app, ["train", *QUICK, *args])


def one_line_error(result: Result) -> str:
    """The refusal's one line: exit 2, a single `error:` line, no traceback."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "Traceback" not in result.output
    return lines[0]
