"""Package discovery for the wheel; everything else is in pyproject.toml.

The repository keeps each top-level package in its own folder (spec/, compiler/, ...) mapped to
an `mxc.*` name by pyproject's package-dir. setuptools' own discovery cannot prefix those names,
so this walks each mapped folder: a new subpackage folder (with an __init__.py) is in the wheel
without anyone listing it."""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def mapped_packages(package_dir: dict[str, str]) -> list[str]:
    packages = set(package_dir)
    for name, folder in package_dir.items():
        packages.update(f"{name}.{sub}" for sub in find_packages(str(HERE / folder)))
    return sorted(packages)


package_dir = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
setup(packages=mapped_packages(package_dir))
