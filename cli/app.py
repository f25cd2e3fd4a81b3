"""Wires the `tierzero` commands; each command lives in its own module.

Domain errors (`TierzeroError`, `StorageError`) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import typer

from tierzero.errors import TierzeroError
from tierzero.storage.base import StorageError
from tierzero.cli.output import fail

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="Train models larger than GPU memory by tiering state across GPU, host and NVMe.")


def _register() -> None:
    from tierzero.cli.train import train
    from tierzero.cli.plan import plan

    app.command()(train)
    app.command()(plan)


_register()


def main() -> None:
    try:
        app()
    except (TierzeroError, StorageError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
