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


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors one safetensors file holds; ValueError naming the file when its header is
    not one."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header's length)")
        (length,) = struct.unpack("<Q", prefix)
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
    return tensors


def find_tensors(folder: str | Path, names: set[str]) -> dict[str, StoredTensor]:
    """Where those of `names` that the folder's checkpoint holds lie. With an index file
    (`model.safetensors.index.json`) only the shards holding them are opened."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / weight_map[n] for n in names if n in weight_map})
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            pass  # an index that cannot be read: every file's header says as much
    found = {}
    for path in files:
        for name, stored in read_header(path).items():
            if name in names:
                found[name] = stored
    return found
