"""What `pip install .` puts in the wheel, and what it needs on the oldest Python it allows.

The wheel itself is built, installed into a fresh venv and run by `.ci/wheel_check`; these
tests hold the two causes of a wheel that cannot import: a package missing from the list
setuptools is given, and a stdlib module the oldest allowed Python lacks."""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "tierzero": ROOT / "tierzero",
    "tierzero.storage": ROOT / "storage",
    "tierzero.cli": ROOT / "cli",
}


def installed_packages() -> tuple[list[str], dict[str, str]]:
    """The packages and package_dir setup.py hands setuptools (setup() is not run)."""
    seen: dict = {}
    original = setuptools.setup
    setuptools.setup = lambda **kwargs: seen.update(kwargs)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = original
    return seen["packages"], seen["package_dir"]


def test_every_package_folder_is_in_the_wheel() -> None:
    packages, package_dir = installed_packages()
    expected = set()
    for name, folder in SOURCES.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            expected.add(".".join([name, *parts]))
    assert expected == set(packages)
    assert package_dir == {"tierzero.storage": "storage", "tierzero.cli": "cli"}


def test_tomllib_has_the_python_310_fallback() -> None:
    """tomllib is new in 3.11; pyproject allows 3.10, where tomli is the same parser."""
    for folder in SOURCES.values():
        for path in folder.rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "version_info" in ast.unparse(node.test):
                    continue
                body = getattr(node, "body", [])
                for stmt in body if isinstance(body, list) else []:
                    if isinstance(stmt, ast.Import) and any(
                        a.name == "tomllib" for a in stmt.names
                    ):
                        raise AssertionError(
                            f"{path.relative_to(ROOT)} imports tomllib without "
                            "the tomli fallback for Python 3.10"
                        )
