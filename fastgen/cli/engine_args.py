"""Engine flags shared by every subcommand, and building the `LLM` they describe.

The flags mirror `fastgen.config.EngineConfig` field by field (same names, dashes for
underscores, the same defaults), so `--help` and the Python API never disagree. Value checks
that need only the flag happen in argparse (`fastgen.cli.arg_types`); checks that combine
flags happen in `resolve_model`; checks that need the model (max_model_len against the model's
context) are the engine's own and surface as `fastgen: error: ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fastgen.cli import arg_types
from fastgen.config import DTYPE_NAMES, EngineConfig
from fastgen.presets import preset_names

LOAD_FORMATS = ("safetensors", "dummy")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.init}


@dataclass(frozen=True)
class ModelChoice:
    """Which model folder to load and how. preset: the preset's name when one was chosen."""

    path: str | None  # None: the default model (resolved lazily: it may need converting first)
    load_format: str
    preset: str | None


def add_engine_args(parser: argparse.ArgumentParser, max_model_len_default: str) -> None:
    """Add the model and engine flags as two groups. `max_model_len_default` describes, for
    --help, what an absent --max-model-len means in this subcommand."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", metavar="PATH", default=None,
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer files). "
        "Default: SmolLM2-135M-Instruct, converted once into $FASTGEN_CACHE (~/.cache/fastgen).",
    )
    model.add_argument(
        "--model-preset", metavar="NAME", choices=preset_names(), default=None,
        help=f"benchmark the shapes of a known model on random weights (implies --load-format dummy); "
        f"one of: {', '.join(preset_names())}",
    )
    model.add_argument(
        "--load-format", choices=LOAD_FORMATS, default=None,
        help="safetensors: real weights from the folder; dummy: random weights, only config.json "
        "needed. Default: dummy with --model-preset, else safetensors.",
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", metavar="N", type=arg_types.positive_int, default=_DEFAULTS["max_num_seqs"],
                        help="most sequences in one step (the decode batch)")
    engine.add_argument("--max-num-batched-tokens", metavar="N", type=arg_types.positive_int,
                        default=_DEFAULTS["max_num_batched_tokens"],
                        help="most prompt tokens computed in one prefill step (longer prompts are chunked)")
    engine.add_argument("--max-model-len", metavar="N", type=arg_types.int_at_least(2), default=None,
                        help=f"longest sequence, prompt + output. Default: {max_model_len_default}.")
    engine.add_argument("--block-size", metavar="N", type=arg_types.positive_int, default=_DEFAULTS["block_size"],
                        help="tokens per KV-cache block")
    engine.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default=_DEFAULTS["dtype"], metavar="DTYPE",
                        help=f"weight and activation dtype, one of: {', '.join(['auto', *DTYPE_NAMES])}; "
                        "auto: the model's own")
    engine.add_argument("--device", type=arg_types.device, default=_DEFAULTS["device"],
                        help="auto (CUDA when present), cpu, cuda or cuda:N")
    engine.add_argument("--gpu-memory-utilization", metavar="FRACTION", type=arg_types.fraction,
                        default=_DEFAULTS["gpu_memory_utilization"],
                        help="share of the GPU's memory the engine may use in total (CUDA only)")
    engine.add_argument("--kv-cache-memory-bytes", type=arg_types.byte_size, default=None, metavar="SIZE",
                        help="explicit KV-cache budget, e.g. 4GiB or 512MiB. "
                        "Default: what --gpu-memory-utilization leaves on CUDA, 1 GiB on CPU.")
    engine.add_argument("--num-kv-blocks", metavar="N", type=arg_types.positive_int, default=None,
                        help="explicit number of KV-cache blocks; wins over both budgets")
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="do not share KV blocks between requests with a common prefix")
    engine.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs for decode")
    engine.add_argument("--compile", dest="use_torch_compile", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="torch.compile the fused ops and the sampler. Default: on CUDA only.")
    engine.add_argument("--seed", metavar="N", type=arg_types.seed, default=_DEFAULTS["seed"],
                        help="seed of the sampler (and of the random workload in bench commands)")


def resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser, need_tokenizer: bool) -> ModelChoice:
    """Check the model flags against each other (parser.error, exit 2, on a bad mix)."""
    preset = args.model_preset
    if preset is not None and args.model is not None:
        parser.error(f"argument --model-preset: {preset!r} cannot be combined with --model {args.model!r}")
    if preset is not None:
        if args.load_format == "safetensors":
            parser.error(f"argument --load-format: 'safetensors' needs real weights, "
                         f"but --model-preset {preset!r} has none; use --load-format dummy")
        if need_tokenizer:
            parser.error(f"argument --model-preset: {preset!r} has no tokenizer, which this command needs; "
                         "pass --model with a folder that has tokenizer files")
        from fastgen.presets import preset_model_dir

        return ModelChoice(str(preset_model_dir(preset)), "dummy", preset)
    load_format = args.load_format or "safetensors"
    if load_format == "dummy" and args.model is None:
        parser.error("argument --load-format: 'dummy' needs --model-preset NAME or --model PATH "
                     "(a folder with a config.json)")
    if args.model is not None and not Path(args.model).is_dir():
        parser.error(f"argument --model: {args.model!r} is not a directory")
    return ModelChoice(args.model, load_format, None)


def engine_kwargs(args: argparse.Namespace, max_model_len: int | None) -> dict:
    """The EngineConfig fields the flags set (max_model_len: the flag's value, else this)."""
    return dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len if args.max_model_len is not None else max_model_len,
        block_size=args.block_size,
        dtype=args.dtype,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        use_torch_compile=args.use_torch_compile,
        seed=args.seed,
    )


def build_llm(choice: ModelChoice, args: argparse.Namespace, *, need_tokenizer: bool,
              needed_model_len: int | None = None, needed_by: str = ""):
    """Build the LLM the flags describe.

    needed_model_len: the longest sequence the command will run. Used as max_model_len when
    --max-model-len is absent, so a model with a 40960-token context does not size its RoPE
    tables for 40960 positions when the workload needs 300; `needed_by` names the flags it came
    from, for the error when the model's context is shorter. Raises ValueError (engine checks).
    """
    from fastgen.llm import LLM
    from fastgen.model_config import ModelConfig

    path = choice.path
    if path is None:
        from fastgen.default_model import default_model_path

        path = str(default_model_path())
    if needed_model_len is not None and args.max_model_len is None:
        limit = ModelConfig.from_folder(path).max_position_embeddings
        if needed_model_len > limit:
            raise ValueError(f"{needed_by} = {needed_model_len} tokens exceeds the model's "
                             f"max_position_embeddings={limit}")
    return LLM(
        path,
        load_format=choice.load_format,
        skip_tokenizer_init=not need_tokenizer,
        **engine_kwargs(args, needed_model_len),
    )
