"""Wires the `tierzero` commands; each command lives in its own module.

Errors are one line on stderr. Bad input -- a domain error (`TierzeroError`, `StorageError`) or
a flag click cannot parse -- is one sentence with a hint, exit code 2. Anything else is a bug or
a failure of the machine: one line naming it and the file its full traceback was written to,
exit code 1. Ctrl-C is exit code 130 and one line, from rank 0 alone when there are several: where
training stopped and what --resume continues from; SIGTERM says the same, with exit code 143 (a
rank that torchrun started keeps SIGTERM's default: that is how torchrun stops the survivors).
When torchrun started several ranks, a domain error is prefixed with the rank that says it.
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
from tierzero.cli.output import fail
from tierzero.storage.base import StorageError
from typer.core import TyperGroup

from tierzero.distributed.launch import RanksStopped, ranks_from_env, under_torchrun
from tierzero.errors import TierzeroError
from tierzero.run.loop import Interrupted


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


app = typer.Typer(
    cls=OneLineErrors,
    add_completion=False,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    help="Train models larger than GPU memory by tiering state across GPU, host and NVMe.",
)


def guarded(command: Callable[..., None]) -> Callable[..., None]:
    """Turn domain errors into one line and exit code 2, and any other exception into one line
    naming the file with its traceback and exit code 1 (also under CliRunner)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        received: list[int] = []
        try:
            with _noting_signals(received):
                command(*args, **kwargs)
        except KeyboardInterrupt as e:
            interrupted(e, received[-1] if received else signal.SIGINT)
        except (TierzeroError, StorageError) as e:
            ranks = ranks_from_env()
            fail(f"rank {ranks.rank}: {e}" if ranks.world_size > 1 else str(e))
        except Exception as e:  # a bug, or the machine failing: keep the evidence, say where
            if received:  # a collective broken by a rank that Ctrl-C stopped first
                interrupted(KeyboardInterrupt(), received[-1])
            path = write_traceback(command.__name__)
            message = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
            fail(
                f"`tierzero {command.__name__}` failed unexpectedly "
                f"({type(e).__name__}: {message}); the full traceback is in {path}, please "
                "include it when you report this",
                code=1,
            )

    return run


def interrupted(e: KeyboardInterrupt, signum: int = signal.SIGINT) -> None:
    """Ctrl-C (or SIGTERM): exit 128 + the signal's number with one line saying where training
    stopped, from rank 0 alone (the launcher of `--nproc` ranks says nothing: its rank 0 spoke);
    another signal that stopped the launcher exits 128 + its number."""
    if isinstance(e, RanksStopped):
        if e.signum == signal.SIGINT:
            raise SystemExit(130)
        fail(
            f"stopped by {signal.Signals(e.signum).name}, which the launcher passed on to the "
            "ranks; the run directory keeps its last complete checkpoint (continue with --resume)",
            code=128 + e.signum,
        )
    code = 128 + signum
    if not ranks_from_env().primary:
        raise SystemExit(code)
    stopped = (
        "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    )
    if not isinstance(e, Interrupted):
        fail(stopped, code=code)
    if e.checkpoint_step is None:
        fail(
            f"{stopped} at step {e.step}; no checkpoint yet (one is written every "
            "--checkpoint-every steps and at the end), so a new run starts from step 0",
            code=code,
        )
    fail(
        f"{stopped} at step {e.step}; last checkpoint step {e.checkpoint_step}; "
        "continue with --resume",
        code=code,
    )


@contextlib.contextmanager
def _noting_signals(received: list[int]) -> Iterator[None]:
    """Note in `received` each SIGINT (or SIGTERM) that arrives, and raise KeyboardInterrupt for
    it, so the training loop stops as for Ctrl-C and a failure it caused elsewhere first -- a peer
    rank's broken collective -- is reported as the interrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        signal.default_int_handler(signum, frame)

    signals = [signal.SIGINT] + ([] if under_torchrun() else [signal.SIGTERM])
    previous = {signum: signal.signal(signum, on_signal) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def write_traceback(command: str) -> Path:
    """Write the exception being handled, with its traceback, to a new file; return its path.
    `TIERZERO_CRASH_DIR` chooses the directory (default: the system's temporary directory)."""
    folder = Path(os.environ.get("TIERZERO_CRASH_DIR") or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(
        prefix=f"tierzero-{command}-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt", dir=folder
    )
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
    from tierzero.cli.generate import generate
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
    app.command()(guarded(generate))


_register()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        fail("interrupted", code=130)
