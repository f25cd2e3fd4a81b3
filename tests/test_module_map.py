"""docs/design.md's module map is the modules' own docstrings: every package and module listed,
one entry each, none missing, none stale (`tests.support.module_map` renders it)."""

from __future__ import annotations

from tests.support import module_map


def test_every_module_says_what_it_owns() -> None:
    silent = [name.strip() for name, text in module_map.entries() if not text]
    assert not silent, f"give these a docstring (what they own, why): {silent}"


def test_the_design_doc_lists_every_module() -> None:
    assert module_map.current(), "docs/design.md has lost its module map markers"
    assert module_map.current() == module_map.render(), (
        "docs/design.md's module map is out of date: "
        "run `python -m tests.support.module_map --write`"
    )
