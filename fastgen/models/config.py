"""What fastgen needs to know about a Hugging Face model folder, read from its config.json.

`ModelConfig` holds the fields every family has and the engine reads (the shapes that size the
KV cache and the sampler, the length limit, the dtype, the EOS ids). Each family subclasses it
with the fields its own layers read and parses config.json with its own `from_hf`; the registry
(`fastgen.models.registry`) says which subclass an architecture uses. Reading a config never
imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from fastgen.models.checkpoint_index import find_tensors
from fastgen.models.config_keys import ConfigKeys
from fastgen.models.registry import ARCHITECTURES, config_class

# Every dtype name fastgen accepts, from users (EngineConfig.dtype) and from config.json, with
# its canonical name. Names, not torch dtypes: reading a config must not import torch.
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEAD_TENSOR = "lm_head.weight"

logger = logging.getLogger(__name__)


def torch_dtype(name: str):
    """The torch dtype of a name in DTYPE_NAMES."""
    import torch

    return getattr(torch, DTYPE_NAMES[name])


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and options of a decoder-only model that the engine itself reads."""

    # The config.json key that holds the length limit, named in errors about max_model_len.
    max_len_key: ClassVar[str] = "max_position_embeddings"
    # The checkpoint names the family's token embedding is saved under.
    embedding_tensors: ClassVar[tuple[str, ...]] = ()

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the MLP's inner width (tensor parallelism splits it)
    max_position_embeddings: int  # the longest sequence the model's positions cover
    tie_word_embeddings: bool
    dtype: str  # canonical name of the checkpoint's dtype (float32 when config.json names none)
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> ModelConfig:
        """The config of the first supported entry of raw["architectures"], as the family's
        subclass, every key it uses checked. Raises ValueError naming `where` and the key for an
        unsupported architecture, a missing or malformed key or a switch the family does not
        implement."""
        keys = ConfigKeys(raw, where)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None) if isinstance(archs, list) else None
        if arch is None:
            raise ValueError(
                f"architectures={archs!r} in {where} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        family, switches = config_class(arch), ARCHITECTURES[arch].switches
        return family.from_hf(keys, arch, **switches)

    @classmethod
    def from_hf(cls, keys: ConfigKeys, architecture: str, **switches) -> ModelConfig:
        """Parse a family's config.json (read through `keys`, which checks each key); each
        family's subclass implements it."""
        raise NotImplementedError(f"{cls.__name__} does not parse config.json")

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not path.is_dir():
            raise ValueError(f"model={str(path)!r} is not a directory")
        if not config_file.is_file():
            raise ValueError(f"model={str(path)!r} has no config.json")
        return cls.from_dict(read_json(config_file), where=str(config_file)).head_as_stored(path)

    def head_as_stored(self, folder: str | Path) -> ModelConfig:
        """This config, untied where config.json ties the LM head to the embeddings but the
        checkpoint holds a head of its own with other values: transformers then uses the
        checkpoint's head, and so does fastgen (tying anyway ran a different model)."""
        if not self.tie_word_embeddings:
            return self
        try:
            found = find_tensors(folder, {HEAD_TENSOR, *self.embedding_tensors})
        except ValueError:
            return self  # no weights to read (dummy weights), or broken ones: the loader says which
        head = found.get(HEAD_TENSOR)
        if head is None:
            return self
        embedding = next((found[n] for n in self.embedding_tensors if n in found), None)
        # A head stored without the embeddings is the tie's one copy (transformers ties the other
        # way round then): the loader fills the embeddings from it.
        if embedding is None or head.same_bytes(embedding):
            return self
        logger.warning("%s: config.json ties the LM head to the embeddings, but the checkpoint's %s holds other "
                       "values; using the checkpoint's head (as transformers does)", folder, HEAD_TENSOR)
        return dataclasses.replace(self, tie_word_embeddings=False)

    def num_parameters(self) -> int:
        """Parameters of the model this config describes (embeddings, layers, final norm, head);
        each family counts its own."""
        raise NotImplementedError(f"{type(self).__name__} does not count its parameters")

    @staticmethod
    def shared_fields(keys: ConfigKeys) -> dict:
        """The fields every family reads from config.json under the same keys (dtype, EOS ids)."""
        dtype_key = "torch_dtype" if keys.raw.get("torch_dtype") else "dtype"
        return dict(dtype=DTYPE_NAMES[keys.string(dtype_key, DTYPE_NAMES, "float32")],
                    eos_token_ids=keys.token_ids("eos_token_id"))

    @property
    def max_len_limit(self) -> str:
        """The length limit as config.json names it, e.g. "n_positions=1024" (for messages)."""
        return f"{self.max_len_key}={self.max_position_embeddings}"

    def kv_bytes_per_token(self, dtype: str, num_kv_heads: int | None = None) -> int:
        """Bytes of K and V one token occupies across all layers when the cache is `dtype` (a name).
        num_kv_heads: the heads one device holds (a tensor-parallel rank's share); default all."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * self.num_layers * heads * self.head_dim * DTYPE_BYTES[DTYPE_NAMES[dtype]]


def read_json(path: Path) -> object:
    """A JSON file's content; ValueError naming the file when it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
