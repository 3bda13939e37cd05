"""dtype="auto" on CPU: bfloat16 for a bfloat16 model where the CPU has native bf16, else float32."""

from __future__ import annotations

import json
import shutil

import pytest

import fastgen.config
from fastgen.config import EngineConfig


@pytest.fixture
def bf16_model(tiny_models, tmp_path):
    """The tiny Llama folder, declared bfloat16 in its config.json."""
    folder = tmp_path / "bf16-llama"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(("native", "want"), [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_on_cpu_follows_native_bf16(bf16_model, monkeypatch, native, want):
    monkeypatch.setattr(fastgen.config, "has_native_bf16", lambda: native)
    assert EngineConfig(model=bf16_model, device="cpu").dtype_name == want


def test_auto_dtype_keeps_a_float32_model_in_float32(tiny_models, monkeypatch):
    monkeypatch.setattr(fastgen.config, "has_native_bf16", lambda: True)
    assert EngineConfig(model=tiny_models["llama"], device="cpu").dtype_name == "float32"


def test_an_explicit_dtype_wins_over_the_cpu_default(bf16_model, monkeypatch):
    monkeypatch.setattr(fastgen.config, "has_native_bf16", lambda: True)
    assert EngineConfig(model=bf16_model, device="cpu", dtype="float32").dtype_name == "float32"

