"""Wires the `tierzero` commands; each command lives in its own module.

Errors are one line on stderr. Bad input -- a domain error (`TierzeroError`, `StorageError`) or
a flag click cannot parse -- is one sentence with a hint, exit code 2. Anything else is a bug or
a failure of the machine: one line naming it and the file its full traceback was written to,
exit code 1. Ctrl-C is exit code 130 and one line, from rank 0 alone when there are several: where
training stopped and what --resume continues from. When torchrun started several ranks, a domain
error is prefixed with the rank that says it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from tierzero.errors import TierzeroError
from tierzero.dist.launch import RanksStopped, ranks_from_env
from tierzero.run.loop import Interrupted
from tierzero.storage.base import StorageError
from tierzero.cli.output import fail


class OneLineErrors(TyperGroup):
    """Click's usage errors (a bad value, an unknown option) as one line, like every other error."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
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
        if not standalone_mode or not code:
            return code
        if code == 130:  # typer's answer to a KeyboardInterrupt outside a command (while parsing)
            fail("interrupted", code=130)
        raise SystemExit(code)


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="Train models larger than GPU memory by tiering state across GPU, host and NVMe.")


def guarded(command: Callable[..., None]) -> Callable[..., None]:
    """Turn domain errors into one line and exit code 2, and any other exception into one line
    naming the file with its traceback and exit code 1 (also under CliRunner)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            with _noting_ctrl_c() as signalled:
                command(*args, **kwargs)
        except KeyboardInterrupt as e:
            interrupted(e)
        except (TierzeroError, StorageError) as e:
            ranks = ranks_from_env()
            fail(f"rank {ranks.rank}: {e}" if ranks.world_size > 1 else str(e))
        except Exception as e:  # a bug, or the machine failing: keep the evidence, say where
            if signalled.is_set():  # a collective broken by a rank that Ctrl-C stopped first
                interrupted(KeyboardInterrupt())
            path = write_traceback(command.__name__)
            message = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
            fail(f"`tierzero {command.__name__}` failed unexpectedly ({type(e).__name__}: {message}); the full "
                 f"traceback is in {path}, please include it when you report this", code=1)

    return run


def interrupted(e: KeyboardInterrupt) -> None:
    """Ctrl-C: exit 130 with one line saying where training stopped, from rank 0 alone (the
    launcher of `--nproc` ranks says nothing: its rank 0 spoke); another signal that stopped the
    launcher exits 128 + its number."""
    if isinstance(e, RanksStopped):
        if e.signum == signal.SIGINT:
            raise SystemExit(130)
        fail(f"stopped by {signal.Signals(e.signum).name}, which the launcher passed on to the ranks; the run "
             "directory keeps its last complete checkpoint (continue with --resume)", code=128 + e.signum)
    if not ranks_from_env().primary:
        raise SystemExit(130)
    if not isinstance(e, Interrupted):
        fail("interrupted", code=130)
    if e.checkpoint_step is None:
        fail(f"interrupted at step {e.step}; no checkpoint yet (one is written every --checkpoint-every steps "
             "and at the end), so a new run starts from step 0", code=130)
    fail(f"interrupted at step {e.step}; last checkpoint step {e.checkpoint_step}; continue with --resume",
         code=130)


@contextlib.contextmanager
def _noting_ctrl_c() -> Iterator[threading.Event]:
    """An event set when SIGINT arrives (which still raises KeyboardInterrupt), so a failure it
    caused elsewhere first -- a peer rank's broken collective -- is reported as the interrupt."""
    signalled = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield signalled
        return

    def on_sigint(signum: int, frame: Any) -> None:
        signalled.set()
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield signalled
    finally:
        signal.signal(signal.SIGINT, previous)


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
