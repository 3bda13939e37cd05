"""The wheel: every package listed, and the kernels inside fastgen's namespace (never a
top-level `kernels`, the name Hugging Face's kernel loader owns in site-packages)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def listed_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_every_package_folder_is_listed():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fastgen").rglob("__init__.py")}
    found.add("fastgen.kernels")  # the top-level kernels/ folder, mapped by package-dir
    assert set(listed_packages()) == found


def test_kernels_import_as_fastgen_kernels_from_the_source_tree():
    import fastgen.kernels

    assert Path(fastgen.kernels.__file__).parent == ROOT / "kernels"
    assert hasattr(fastgen.kernels, "paged_decode_attention")


@pytest.mark.slow
def test_wheel_has_no_top_level_kernels(tmp_path):
    # Built from a clean copy: a `build/` folder left in the checkout keeps modules that moved
    # away, and setuptools would ship them.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        "build", ".venv", ".git", "*.egg-info", ".gpu-cache", "__pycache__", ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, timeout=600)
    (wheel,) = tmp_path.glob("fastgen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert "kernels" not in top_level
    assert "fastgen/kernels/__init__.py" in names and "fastgen/kernels/paged_decode_attention.py" in names
    assert "fastgen/engine/scheduler.py" in names and "fastgen/model_runner.py" in names
    shipped = {name for name in names if name.endswith((".py", ".cpp", ".h"))}
    in_tree = {f"fastgen/{path.relative_to(ROOT / 'fastgen')}" for path in (ROOT / "fastgen").rglob("*")
               if path.suffix in (".py", ".cpp", ".h")}
    in_tree |= {f"fastgen/kernels/{path.name}" for path in (ROOT / "kernels").glob("*.py")}
    assert shipped == in_tree, (sorted(shipped - in_tree), sorted(in_tree - shipped))
