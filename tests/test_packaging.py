"""The wheel is the product: built from a copy of the sources, installed into a fresh venv, it
imports as `mxc.*` from that venv (not from the repository), ships the zoo and the grammar, and
its `mxc` console script works from an unrelated folder."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*command, cwd=None, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=cwd,
                            env=env, timeout=300)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


def copy_sources(target: Path) -> None:
    """What setuptools reads: pyproject, the readme, and every folder package-dir maps; a copy,
    so the build leaves no build/ or egg-info in the working tree."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    target.mkdir()
    shutil.copy(REPO / "pyproject.toml", target)
    shutil.copy(REPO / "setup.py", target)  # it discovers the subpackages
    shutil.copy(REPO / project["project"]["readme"], target)
    # A nested package's folder (compiler/lower) lies inside its parent's and comes with it.
    for folder in sorted(f for f in folders if not any(f.startswith(o + "/") for o in folders)):
        shutil.copytree(REPO / folder, target / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding only the mxc wheel; it sees the dependencies through a .pth file."""
    root = tmp_path_factory.mktemp("packaging")
    copy_sources(root / "src")
    # The `build` frontend (a test dependency), without isolation: it uses this venv's setuptools
    # instead of fetching one.
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", root / "dist", root / "src")
    (wheel,) = (root / "dist").glob("mxc-*.whl")
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--quiet", wheel)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # The dependencies (jax, pydantic, lark, rich...) come from the venv running this test. A
    # path in a .pth is only appended to sys.path: that folder's own .pth files (the editable
    # install of mxc among them) are not run, so mxc can only come from the wheel.
    deps = [p for p in sys.path if p.endswith("site-packages")] or [sysconfig.get_paths()["purelib"]]
    (site_packages / "deps.pth").write_text("\n".join(deps) + "\n")
    return root


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MXC_DEBUG", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_wheel_contents(installed):
    (wheel,) = (installed / "dist").glob("mxc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mxc/spec/mspec.lark" in names
    zoo = sorted(p.name for p in (REPO / "models").glob("*.mspec"))
    assert zoo and sorted(n.split("/")[-1] for n in names if n.startswith("mxc/models/")
                          and n.endswith(".mspec")) == zoo
    assert "mxc/compiler/cli.py" in names and "mxc/compiler/commands/check.py" in names
    assert not any(n.startswith("tests/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mxc = mxc.compiler.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def repository_modules() -> set[str]:
    """Every module the wheel must ship, found by walking the mapped folders (not by setup.py's
    discovery): each .py in a folder that has an __init__.py, under its mxc.* name."""
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = set()
    for name, folder in package_dir.items():
        for init in (REPO / folder).rglob("__init__.py"):
            package = ".".join([name, *init.parent.relative_to(REPO / folder).parts])
            modules.update(f"mxc/{package.removeprefix('mxc').lstrip('.').replace('.', '/')}/{py.name}"
                           .replace("mxc//", "mxc/") for py in init.parent.glob("*.py"))
    return modules


def test_wheel_ships_every_module_of_every_package_folder(installed):
    (wheel,) = (installed / "dist").glob("mxc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = repository_modules()
    assert "mxc/compiler/lower/sharding.py" in expected and "mxc/__init__.py" in expected
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"


def probe(installed: Path, cwd: Path, *modules: str) -> dict:
    """tests/wheel_probe.py run by the venv's python: where each module came from."""
    python = installed / "venv" / "bin" / "python"
    return json.loads(run(python, Path(__file__).with_name("wheel_probe.py"), *modules,
                          cwd=cwd, env=clean_env()).stdout)


def test_every_module_of_the_wheel_imports_from_the_venv(installed, tmp_path):
    (wheel,) = (installed / "dist").glob("mxc-*.whl")
    modules = sorted(n.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                     for n in zipfile.ZipFile(wheel).namelist()
                     if n.endswith(".py") and not n.endswith("/__main__.py"))  # that one runs the CLI
    found = probe(installed, tmp_path, *modules)
    venv = (installed / "venv").resolve()
    assert set(found["files"]) == set(modules)
    outside = {m: f for m, f in found["files"].items() if not Path(f).resolve().is_relative_to(venv)}
    assert not outside


def test_one_version_number(installed, tmp_path):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    result = run(installed / "venv" / "bin" / "mxc", "--version", cwd=tmp_path, env=clean_env())
    assert result.stdout.strip() == f"mxc {version}"
    assert f'"{version}"' not in (REPO / "mxc_pkg" / "__init__.py").read_text()  # read, not repeated


def test_installed_package_imports_from_the_venv(installed, tmp_path):
    venv = installed / "venv"
    found = probe(installed, tmp_path, "mxc", "mxc.spec", "mxc.compiler", "mxc.runtime", "mxc.compiler.cli")
    for path in found["files"].values():
        path = Path(path).resolve()
        assert path.is_relative_to(venv.resolve()), path
        assert not path.is_relative_to(REPO)
    assert (found["name"], found["layers"]) == ("llama3.1-8b", 32)


def test_installed_console_script(installed, tmp_path):
    mxc = installed / "venv" / "bin" / "mxc"
    result = run(mxc, "check", "llama3.1-8b", "--json", cwd=tmp_path, env=clean_env())
    assert json.loads(result.stdout)["total_params"] == 8030261248
    missing = subprocess.run([str(mxc), "check", "nope.mspec"], capture_output=True, text=True,
                             cwd=tmp_path, env=clean_env(), timeout=120)
    assert missing.returncode == 1
    assert missing.stderr.strip() == "mxc: error: no such file: nope.mspec"
