"""Where each tensor of a safetensors checkpoint lies, read from the files' headers alone.

A safetensors file starts with an 8-byte little-endian length and that many bytes of JSON naming
each tensor's dtype, shape and byte range; nothing else needs reading to know what a checkpoint
holds. Reading a config must not import torch, so this module reads bytes, not tensors.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 24  # bytes compared at a time


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's place: its file, dtype name, shape and absolute byte range in the file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    def same_bytes(self, other: StoredTensor) -> bool:
        """Whether both hold the same values stored the same way (dtype, shape and bytes)."""
        if (self.dtype, self.shape, self.end - self.begin) != (other.dtype, other.shape, other.end - other.begin):
            return False
        with open(self.path, "rb") as a, open(other.path, "rb") as b:
            a.seek(self.begin)
            b.seek(other.begin)
            left = self.end - self.begin
            while left:
                n = min(left, _CHUNK)
                if a.read(n) != b.read(n):
                    return False
                left -= n
        return True


INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors one safetensors file holds; ValueError naming the file when its header is
    not one (a git-lfs pointer left in place of the weights, say)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header's length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER_BYTES, path.stat().st_size - 8):
            raise ValueError(f"{path} is not a safetensors file (its header's length {length} is past the file's "
                             "end or safetensors' 100 MB limit)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
    data_start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            tensors[name] = StoredTensor(path, str(entry["dtype"]), tuple(entry["shape"]),
                                         data_start + int(begin), data_start + int(end))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: the header's entry for {name!r} is malformed") from None
    end = max((t.end for t in tensors.values()), default=data_start)
    if end > path.stat().st_size:
        raise ValueError(f"{path} is cut short: its tensors end at byte {end:,}, the file at "
                         f"{path.stat().st_size:,} (an unfinished download?)")
    return tensors


def weight_map(folder: Path) -> dict[str, str] | None:
    """The index's tensor name -> file name (None without an index); ValueError naming the
    index when it is not one."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    try:
        mapping = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map')") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ValueError(f"{index}: its weight_map must map tensor names to file names")
    return mapping


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files that hold a folder's weights: model.safetensors where there is one
    (transformers' first choice: a folder saved sharded and then whole keeps the old index);
    else the files its index names (Mistral's repositories ship consolidated.safetensors, their
    own format, beside the indexed shards); else, fastgen's own fallback, every *.safetensors.
    ValueError when there are none, or the index names a file that is missing."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    mapping = weight_map(folder)
    if mapping is not None:
        files = sorted({folder / name for name in mapping.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder / INDEX_FILE} names weight files the folder lacks: {missing[:3]}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(folder)!r} has no *.safetensors weight files")
    return files


def find_tensors(folder: str | Path, names: set[str]) -> dict[str, StoredTensor]:
    """Where those of `names` that the folder's checkpoint holds lie. With an index only the
    shards holding them are opened."""
    folder = Path(folder)
    files = checkpoint_files(folder)
    mapping = weight_map(folder) if len(files) > 1 else None
    if mapping is not None:
        wanted = {folder / mapping[n] for n in names if n in mapping}
        files = [f for f in files if f in wanted]
    found = {}
    for path in files:
        for name, stored in read_header(path).items():
            if name in names:
                found[name] = stored
    return found
