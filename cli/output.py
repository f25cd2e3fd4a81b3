"""One object that knows how to speak to the user: human (rich) or machine (JSON) mode.

Text goes through rich markup, so every string the user supplied (a model name, a path, a
config value) or a library quotes is passed through `escape` where it is printed; emoji codes
are off everywhere (`hf:rocket:` is a name, not a rocket), which `escape` alone would not stop."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet  # ranks other than 0 of a multi-rank run say nothing
        self.console = Console(stderr=json_mode, soft_wrap=True, quiet=quiet, emoji=False)

    def emit_json(self, obj: Any) -> None:
        if not self.quiet:
            sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.console.print(*args, **kwargs)


def fail(message: str, code: int = 2) -> None:
    """One sentence to stderr, then exit with `code`: the CLI's only way to report bad input."""
    # escaped: messages quote paths and library errors ("[/path/pair.cc:537] ...") that are not
    # markup
    Console(stderr=True, soft_wrap=True, emoji=False).print(
        f"[bold red]error:[/] {escape(message)}", highlight=False
    )
    raise SystemExit(code)
