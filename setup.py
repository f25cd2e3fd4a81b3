"""Package discovery: `tierzero` and every package under it, with `storage/` and `cli/` installed
as `tierzero.storage` and `tierzero.cli` (and their subpackages). Found, never listed by hand,
so a new subpackage cannot be left out of the wheel. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

MAPPED = {"tierzero.storage": "storage", "tierzero.cli": "cli"}  # installed name -> folder

packages = find_packages(include=["tierzero", "tierzero.*"])
for name, folder in MAPPED.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(where=folder))]

setup(packages=packages, package_dir=MAPPED)
