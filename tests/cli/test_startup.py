"""The command line starts fast: argument parsing and --help load neither torch nor transformers."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
from fastgen.cli.main import build_parser
parser = build_parser()
for argv in (["--help"], ["bench", "throughput", "--help"], ["generate", "--help"], ["bench", "compare", "--help"],
             ["serve", "--help"], ["bench", "serve", "--help"]):
    try:
        parser.parse_args(argv)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "transformers", "numpy", "triton") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_help_imports_neither_torch_nor_transformers():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "HEAVY []"


def test_version_prints_the_package_version():
    import fastgen

    out = subprocess.run([sys.executable, "-m", "fastgen", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"fastgen {fastgen.__version__}"
