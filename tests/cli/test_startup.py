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


def test_serve_answers_at_once_while_its_graphs_compile_in_the_background(monkeypatch):
    """`fastgen serve` warms up (loads or compiles its CPU graphs before listening) unless a
    background compile is under way: there is nothing to load then, and the eager warm-up only
    held up the first answer (21 s against 12 s with empty caches on two cores)."""
    from types import SimpleNamespace

    import fastgen.bench.runner
    import fastgen.serve.app
    from fastgen.cli import engine_args
    from fastgen.cli.main import build_parser
    from fastgen.cli.serve import run

    warmed, served = [], []
    monkeypatch.setattr(fastgen.bench.runner, "warm_up", lambda engine, max_model_len: warmed.append(engine))
    monkeypatch.setattr(fastgen.serve.app, "serve", lambda llm, settings: served.append(llm))
    monkeypatch.setattr(fastgen.serve.app, "bind", lambda settings: SimpleNamespace(
        getsockname=lambda: (settings.host, settings.port), close=lambda: None))
    monkeypatch.setattr(engine_args, "resolve_model", lambda *args, **kwargs: None)
    for background, warms in ((SimpleNamespace(running=True), False), (SimpleNamespace(running=False), True),
                              (None, True)):
        compiled = SimpleNamespace(background=background)
        llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(compiled_decode=compiled)),
                              config=SimpleNamespace(model="m", max_model_len=64))
        monkeypatch.setattr(engine_args, "build_llm", lambda *args, **kwargs: llm)
        warmed.clear()
        args = build_parser().parse_args(["serve"])
        assert run(args) == 0 and served[-1] is llm
        assert bool(warmed) == warms
