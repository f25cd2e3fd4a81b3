"""Wires the `tierzero` commands; each command lives in its own module.

Domain errors (`TierzeroError`, `StorageError`) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer

from tierzero.errors import TierzeroError
from tierzero.storage.base import StorageError
from tierzero.cli.output import fail

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="Train models larger than GPU memory by tiering state across GPU, host and NVMe.")


def guarded(command: Callable[..., None]) -> Callable[..., None]:
    """Turn domain errors into one line on stderr and exit code 2 (also under CliRunner)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except (TierzeroError, StorageError) as e:
            fail(str(e))

    return run


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
