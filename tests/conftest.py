"""Shared fixtures: tiny random models of each family, built once per test session, and
transformers' greedy output on them (the reference every engine test compares against)."""

from __future__ import annotations

import os

import torch

# Triton reads this when a kernel is decorated, so it must be set before `kernels` is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines decode eagerly unless a test asks otherwise (enforce_eager=False): the compiled CPU
# decode step costs tens of seconds an engine, and hundreds of engines are built here.
# tests/cpu/test_compiled_decode.py covers it against transformers.
os.environ.setdefault("FASTGEN_ENFORCE_EAGER", "1")

import random  # noqa: E402
from functools import lru_cache  # noqa: E402

import pytest  # noqa: E402

from tests.markers import skip_cuda_tests_without_gpu  # noqa: E402
from tests.tiny_models import VOCAB_SIZE, build_tiny_model, hf_greedy  # noqa: E402

FAMILIES = ("qwen3", "qwen2", "llama", "gpt2")


def pytest_collection_modifyitems(config, items):
    skip_cuda_tests_without_gpu(items)


@pytest.fixture(autouse=True)
def no_kernel_builds_in_the_background(monkeypatch):
    """Engines here do not start building the CPU kernels at construction
    (`fastgen.cpu.native.prebuild`): each test's builds happen at first use, in its own cache
    folder, and none runs on into the next test (tests/cpu/test_decode_attention.py turns them
    on where it tests them)."""
    from fastgen.cpu.native import prebuild

    monkeypatch.setattr(prebuild, "ENABLED", False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {family: str(build_tiny_model(family, root / family)) for family in FAMILIES}


@lru_cache(maxsize=None)
def _reference(model_dir: str, prompts: tuple[tuple[int, ...], ...], max_new_tokens: int):
    return hf_greedy(model_dir, [list(p) for p in prompts], max_new_tokens)


@pytest.fixture(scope="session")
def reference():
    """reference(model_dir, prompts, max_new_tokens) -> transformers' greedy tokens (memoised)."""
    return lambda model_dir, prompts, n: _reference(model_dir, tuple(map(tuple, prompts)), n)


def random_prompts(lengths, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(1, VOCAB_SIZE) for _ in range(n)] for n in lengths]


@pytest.fixture
def private_cache(monkeypatch, tmp_path):
    """FASTGEN_CACHE pointed at a fresh folder for in-process runs."""
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
