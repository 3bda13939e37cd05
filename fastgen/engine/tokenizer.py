"""The model folder's tokenizer, and the token ids that end generation."""

from __future__ import annotations

from pathlib import Path

from fastgen.models.config import ModelConfig, read_json
from fastgen.models.config_keys import ConfigKeys

# Files that carry a vocabulary; without one, transformers 5 silently builds an empty tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str):
    if not any((Path(model) / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"model={model!r}: could not load its tokenizer (none of {list(_TOKENIZER_FILES)} found; "
            "pass skip_tokenizer_init=True to serve token ids only)"
        )
    from transformers import AutoTokenizer  # seconds to import: only when a tokenizer is needed

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"model={model!r}: could not load its tokenizer ({exc})") from exc


def eos_token_ids(model: str, model_config: ModelConfig, tokenizer) -> set[int]:
    """The ids that end generation, as transformers' generate() reads them: generation_config's
    eos_token_id when the folder has one, else config.json's, else the tokenizer's."""
    gen_file = Path(model) / "generation_config.json"
    if gen_file.is_file():
        eos = ConfigKeys(read_json(gen_file), str(gen_file)).token_ids("eos_token_id")
        if eos:
            return set(eos)
    if model_config.eos_token_ids:
        return set(model_config.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if eos is not None else set()
