"""Model names a user may pass: a folder, or a Hugging Face id found in the local cache.

Resolution is offline (`local_files_only`): fastgen never downloads at start-up, and an id that
is not in the cache is a clear error naming it and the cache searched.
"""

from __future__ import annotations

import re
from pathlib import Path

# `org/name` or `name`: what the Hub accepts as a model id (and nothing that looks like a path).
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def resolve_model_path(model: str) -> str:
    """`model` itself when it is a folder; the folder converted from it when it is a GGUF file
    (`fastgen.models.gguf_weights.gguf_folder`); else the cached snapshot folder of the Hugging
    Face id `model`. Raises ValueError naming the id when it is none of these."""
    if Path(model).is_dir():
        return model
    if model.endswith(".gguf") and Path(model).is_file():
        from fastgen.models.gguf_weights import gguf_folder

        return str(gguf_folder(model))
    if not _MODEL_ID.fullmatch(model) or model.endswith((".", "..")):
        raise ValueError(f"model={model!r} is not a directory")
    # Imported here: only needed for ids, and it costs a few hundred milliseconds to import.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(model, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise ValueError(
            f"model={model!r} is neither a directory nor a model id in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it first (`hf download {model}`) or pass a folder"
        ) from exc
