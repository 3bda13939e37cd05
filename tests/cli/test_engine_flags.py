"""Engine flags come from EngineConfig's fields: one flag per field, the field's default and
docstring, the field's own check on the value."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from fastgen.cli.engine_args import add_engine_args, engine_fields, engine_kwargs
from fastgen.config import EngineConfig, field_docs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p, max_model_len_default="the model's", dummy_weights=True)
    return p


def test_every_config_field_has_a_flag_with_its_default_and_doc():
    p = parser()
    actions = {a.dest: a for a in p._actions}
    docs = field_docs()
    for f in dataclasses.fields(EngineConfig):
        if not f.init or f.name == "model":
            continue
        assert f.name in actions, f"EngineConfig.{f.name} has no flag"
        action = actions[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert action.default == f.default
        assert docs[f.name].split(" Default:")[0] in action.help
    # Every field the constructor takes has a flag; the derived ones (model_config, gguf_file) none.
    assert {f.name for f in engine_fields()} == {f.name for f in dataclasses.fields(EngineConfig) if f.init} - {"model"}


def test_no_flags_give_the_config_defaults():
    args = parser().parse_args([])
    defaults = {f.name: f.default for f in engine_fields()}
    assert engine_kwargs(args, max_model_len=None) == defaults


def test_flags_parse_by_field_type():
    args = parser().parse_args(["--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
                                "--kv-cache-memory-bytes", "4MiB", "--cuda-graph-batch-sizes", "1,2,8",
                                "--no-enable-prefix-caching", "--use-torch-compile", "--dtype", "bf16"])
    kwargs = engine_kwargs(args, max_model_len=64)
    assert kwargs["max_num_seqs"] == 8 and kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["kv_cache_memory_bytes"] == 4 << 20 and kwargs["cuda_graph_batch_sizes"] == [1, 2, 8]
    assert kwargs["enable_prefix_caching"] is False and kwargs["use_torch_compile"] is True
    assert kwargs["dtype"] == "bf16" and kwargs["max_model_len"] == 64


@pytest.mark.parametrize("argv, words", [
    (["--max-num-seqs", "0"], ["max_num_seqs=0 must be >= 1"]),
    (["--cuda-graph-batch-sizes", "4,0"], ["cuda_graph_batch_sizes=0 must be >= 1"]),
    (["--max-cuda-graph-batch-size", "x"], ["'x'", "integer"]),
])
def test_flag_values_run_the_fields_check(argv, words):
    with pytest.raises(argparse.ArgumentError) as info:
        parser().parse_args(argv)
    for word in words:
        assert word in str(info.value)


def test_generate_decodes_eagerly_unless_asked_and_bench_compiles():
    """A one-shot `generate` would pay the compiled step's trace on every start; the bench and
    the server keep the config's default (compiled on CPU)."""
    from fastgen.cli.main import build_parser

    cli = build_parser()
    assert cli.parse_args(["generate", "hi"]).enforce_eager is True
    assert cli.parse_args(["generate", "--no-enforce-eager", "hi"]).enforce_eager is False
    assert cli.parse_args(["bench", "latency"]).enforce_eager is None
