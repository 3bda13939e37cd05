"""Engine flags, generated from `EngineConfig`'s fields, and building the `LLM` they describe.

Every init field but `model` becomes `--field-name` (dashes for underscores) with the field's
default, its docstring as help, and a converter that parses the text by the field's type and
then runs the field's own check, so a bad value exits 2 naming the flag, the value and the
limit before anything loads. Booleans get `--name/--no-name`. A new field is a new flag with
no edit here. The model flags (`--model`, `--model-preset`, `--load-format`) are this module's
own: they choose a folder, which is not an engine setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import types
import typing
from dataclasses import dataclass

from fastgen.cli import arg_types
from fastgen.config import DTYPE_CHOICES, LOAD_FORMATS, EngineConfig, field_docs
from fastgen.models.hub import resolve_model_path
from fastgen.models.presets import preset_names

_NOT_FLAGS = {"model"}


@dataclass(frozen=True)
class ModelChoice:
    """Which model folder to load and how. preset: the preset's name when one was chosen."""

    path: str | None  # None: the default model (resolved lazily: it may need converting first)
    load_format: str
    preset: str | None


def engine_fields() -> list[dataclasses.Field]:
    """The EngineConfig fields that are flags."""
    return [f for f in dataclasses.fields(EngineConfig) if f.init and f.name not in _NOT_FLAGS]


def _base_type(annotation) -> type:
    """int for `int | None`, list for `list[int] | None`, and so on."""
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    return typing.get_origin(hint) or hint


def _parser_of(f: dataclasses.Field):
    """Text -> value by the field's type; sizes in bytes also take units (4GiB)."""
    kind = _base_type(f.type)
    if f.name.endswith("_bytes"):
        return arg_types.byte_size
    if kind is list:
        return arg_types.int_list
    if kind is dict:
        return arg_types.json_object
    return {int: arg_types.integer, float: arg_types.number, str: str}[kind]


def _converter(f: dataclasses.Field):
    parse, check = _parser_of(f), f.metadata.get("check")

    def convert(text: str):
        value = parse(text)
        if check is not None:
            try:
                value = check(f.name, value)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"invalid value {text!r}: {exc}") from None
        return value

    convert.__name__ = f.name  # what argparse names in "invalid <name> value"
    return convert


def add_engine_args(parser: argparse.ArgumentParser, max_model_len_default: str, dummy_weights: bool) -> None:
    """Add the model and engine flags as two groups. `max_model_len_default` describes, for
    --help, what an absent --max-model-len means in this subcommand; `dummy_weights` adds
    --model-preset and --load-format (for commands that can run on random weights)."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", metavar="PATH_OR_ID", default=None,
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer files), or a model id "
        "such as HuggingFaceTB/SmolLM2-135M-Instruct found in the local Hugging Face cache. "
        "Default: SmolLM2-135M-Instruct, converted once into $FASTGEN_CACHE (~/.cache/fastgen).",
    )
    if dummy_weights:
        _add_dummy_weight_args(model)
    engine = parser.add_argument_group("engine")
    docs = field_docs()
    for f in engine_fields():
        flag = "--" + f.name.replace("_", "-")
        doc = docs[f.name]
        if f.name == "max_model_len":
            doc = doc.split(" Default:")[0] + f" Default: {max_model_len_default}."
        if _base_type(f.type) is bool:
            engine.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=doc)
        elif f.name == "dtype":
            engine.add_argument(flag, dest=f.name, choices=DTYPE_CHOICES, default=f.default, metavar="DTYPE",
                                help=f"{doc} One of: {', '.join(DTYPE_CHOICES)}.")
        else:
            engine.add_argument(flag, dest=f.name, type=_converter(f), default=f.default,
                                metavar=f.name.rsplit("_", 1)[-1].upper(), help=doc)


def _add_dummy_weight_args(model: argparse._ArgumentGroup) -> None:
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


def engine_kwargs(args: argparse.Namespace, max_model_len: int | None) -> dict:
    """The EngineConfig fields the flags set (max_model_len: the flag's value, else this)."""
    kwargs = {f.name: getattr(args, f.name) for f in engine_fields()}
    if kwargs["max_model_len"] is None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser, need_tokenizer: bool) -> ModelChoice:
    """Check the model flags against each other (parser.error, exit 2, on a bad mix)."""
    preset = getattr(args, "model_preset", None)
    if preset is not None and args.model is not None:
        parser.error(f"argument --model-preset: {preset!r} cannot be combined with --model {args.model!r}")
    if preset is not None:
        if getattr(args, "load_format", None) == "safetensors":
            parser.error(f"argument --load-format: 'safetensors' needs real weights, "
                         f"but --model-preset {preset!r} has none; use --load-format dummy")
        if need_tokenizer:
            parser.error(f"argument --model-preset: {preset!r} has no tokenizer, which this command needs; "
                         "pass --model with a folder that has tokenizer files")
        from fastgen.models.presets import preset_model_dir

        return ModelChoice(str(preset_model_dir(preset)), "dummy", preset)
    load_format = getattr(args, "load_format", None) or "safetensors"
    if load_format == "dummy" and args.model is None:
        parser.error("argument --load-format: 'dummy' needs --model-preset NAME or --model PATH "
                     "(a folder with a config.json)")
    path = None
    if args.model is not None:
        try:
            path = resolve_model_path(args.model)
        except ValueError as exc:
            parser.error(f"argument --model: {exc}")
    return ModelChoice(path, load_format, None)


def build_llm(choice: ModelChoice, args: argparse.Namespace, *, need_tokenizer: bool,
              needed_model_len: int | None = None, needed_by: str = ""):
    """Build the LLM the flags describe.

    needed_model_len: the longest sequence the command will run. Used as max_model_len when
    --max-model-len is absent, so a model with a 40960-token context does not size its RoPE
    tables for 40960 positions when the workload needs 300; `needed_by` names the flags it came
    from, for the error when the model's context is shorter. Raises ValueError (engine checks).
    """
    from fastgen.llm import LLM
    from fastgen.models.config import ModelConfig

    path = choice.path
    if path is None:
        from fastgen.cpu.native.prebuild import build_cpu_kernels_in_background
        from fastgen.models.default_model import default_model_path

        build_cpu_kernels_in_background(args.device)  # beside a first use's conversion
        path = str(default_model_path())
    if needed_model_len is not None and args.max_model_len is None:
        model_config = ModelConfig.from_folder(path)
        if needed_model_len > model_config.max_position_embeddings:
            raise ValueError(f"{needed_by} = {needed_model_len} tokens exceeds the model's "
                             f"{model_config.max_len_limit}")
    elif needed_model_len is not None and needed_model_len > args.max_model_len:
        # Before the model loads and warms up: the workload may draw a request the engine refuses.
        raise ValueError(f"{needed_by} = {needed_model_len} tokens exceeds --max-model-len {args.max_model_len}")
    status(f"loading {choice.preset or path} ({choice.load_format} weights)")
    start = time.perf_counter()
    llm = LLM(path, load_format=choice.load_format, skip_tokenizer_init=not need_tokenizer,
              **engine_kwargs(args, needed_model_len))
    status(f"ready in {time.perf_counter() - start:.1f} s: {llm.config.model_config.architecture} on "
           f"{llm.engine.runner.device}, {llm.config.dtype_name}, {llm.engine.runner.num_kv_blocks} KV blocks")
    if (background := getattr(llm.engine.runner.compiled_decode, "background", None)) and background.running:
        status(f"compiling the CPU step graphs in the background (log: {background.log_path}); "
               "steps run eagerly until each is ready")
    return llm


def status(message: str) -> None:
    """A progress line for a person at a terminal (stderr, and only when it is one)."""
    if sys.stderr.isatty():
        print(f"fastgen: {message}", file=sys.stderr, flush=True)
