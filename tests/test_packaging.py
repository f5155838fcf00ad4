"""The wheel holds the whole package: every Python package under cuflash/, every template and
every other file the code reads (pyproject.toml lists them by hand, so a new directory or file
kind must be added there)."""
import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11 (tomllib)")

ROOT = Path(__file__).resolve().parent.parent


def _setuptools():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_dir(cfg, package):
    """The source directory setuptools takes ``package`` from."""
    mapped = cfg.get("package-dir", {})
    if package in mapped:
        return ROOT / mapped[package]
    return ROOT.joinpath(*package.split("."))


def test_every_package_and_template_directory_is_packaged():
    cfg = _setuptools()
    packages = set(cfg["packages"])
    python = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cuflash").rglob("__init__.py")}
    templates = {"cuflash.templates"} | {"cuflash.templates." + d.name for d in (ROOT / "templates").iterdir()
                                         if d.is_dir() and d.name != "__pycache__"}
    assert python <= packages, f"packages missing from pyproject.toml: {sorted(python - packages)}"
    assert templates <= packages, f"template directories missing from pyproject.toml: {sorted(templates - packages)}"
    for p in packages:
        assert _source_dir(cfg, p).is_dir(), p


def test_every_data_file_is_packaged():
    """Each file in a packaged directory that is not Python source matches its package's
    package-data patterns."""
    cfg = _setuptools()
    data = cfg.get("package-data", {})
    for p in cfg["packages"]:
        for f in _source_dir(cfg, p).iterdir():
            if f.is_file() and f.suffix not in (".py", ".pyc"):
                assert any(fnmatch.fnmatch(f.name, pat) for pat in data.get(p, [])), (
                    f"{f.relative_to(ROOT)} is not in pyproject.toml's package-data for {p}")
