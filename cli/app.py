"""Wires the `tierzero` commands; each command lives in its own module.

Errors are one line on stderr. Bad input -- a domain error (`TierzeroError`, `StorageError`) or
a flag click cannot parse -- is one sentence with a hint, exit code 2. Anything else is a bug or
a failure of the machine: one line naming it and the file its full traceback was written to,
exit code 1. Ctrl-C is `interrupted`, exit code 130. When torchrun started several ranks, a
domain error is prefixed with the rank that says it.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from tierzero.errors import TierzeroError
from tierzero.dist.launch import ranks_from_env
from tierzero.storage.base import StorageError
from tierzero.cli.output import fail


class OneLineErrors(TyperGroup):
    """Click's usage errors (a bad value, an unknown option) as one line, like every other error."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except typer.Abort:
            if not standalone_mode:
                raise
            fail("interrupted", code=130)
        except typer.TyperException as e:  # click's exceptions, as typer vendors them
            if not standalone_mode:
                raise
            if getattr(e, "exit_code", 1) != 2:  # not a usage error: click's own report
                e.show()
                raise SystemExit(e.exit_code) from None
            ctx = getattr(e, "ctx", None)
            command = ctx.command_path if ctx is not None else "tierzero"
            fail(f"{_sentence(e.format_message())}; see `{command} --help`")


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="Train models larger than GPU memory by tiering state across GPU, host and NVMe.")


def guarded(command: Callable[..., None]) -> Callable[..., None]:
    """Turn domain errors into one line and exit code 2, and any other exception into one line
    naming the file with its traceback and exit code 1 (also under CliRunner)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except (TierzeroError, StorageError) as e:
            ranks = ranks_from_env()
            fail(f"rank {ranks.rank}: {e}" if ranks.world_size > 1 else str(e))
        except Exception as e:  # a bug, or the machine failing: keep the evidence, say where
            path = write_traceback(command.__name__)
            message = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
            fail(f"`tierzero {command.__name__}` failed unexpectedly ({type(e).__name__}: {message}); the full "
                 f"traceback is in {path}, please include it when you report this", code=1)

    return run


def write_traceback(command: str) -> Path:
    """Write the exception being handled, with its traceback, to a new file; return its path.
    `TIERZERO_CRASH_DIR` chooses the directory (default: the system's temporary directory)."""
    folder = Path(os.environ.get("TIERZERO_CRASH_DIR") or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"tierzero-{command}-{time.strftime('%Y%m%d-%H%M%S')}-",
                                suffix=".txt", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(traceback.format_exc())
    return Path(name)


def _sentence(message: str) -> str:
    """Click's message as a sentence that continues: lower-case start, no final period."""
    message = " ".join(message.split()).rstrip(".")
    return message[:1].lower() + message[1:]


def _register() -> None:
    from tierzero.cli.bench import bench
    from tierzero.cli.export import export
    from tierzero.cli.inspect import inspect
    from tierzero.cli.plan import plan
    from tierzero.cli.report import report
    from tierzero.cli.train import train

    app.command()(guarded(train))
    app.command()(guarded(plan))
    app.command()(guarded(bench))
    app.command()(guarded(report))
    app.command()(guarded(export))
    app.command()(guarded(inspect))


_register()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        fail("interrupted", code=130)
