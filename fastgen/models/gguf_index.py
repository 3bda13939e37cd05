"""A GGUF file's tensors — name, type, shape and their bytes as a memory map — read from its
header without decoding its metadata.

The gguf package's `GGUFReader` decodes every metadata value into numpy arrays field by field;
for the default model's file, whose tokenizer holds about 100k strings (tokens and merges), that
is 2.6 s, paid by every reader of the file (the one-time conversion, and each engine start with
`quantization="gguf"`). Only the tensor index is needed there: values are stepped over (a string
array by its lengths alone), and the tensors come out as `GGUFReader` gives them. Files this
reader does not know (another version, big-endian) are handed to `GGUFReader`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# GGUF metadata value types of fixed size -> bytes (uint8, int8, uint16, int16, uint32, int32,
# float32, bool, -, -, uint64, int64, float64).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_ALIGNMENT_KEY = b"general.alignment"
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file. shape: GGUF's order, the fastest dimension first. data: as
    `GGUFReader` gives it — a typed array in torch's dimension order for float and integer types,
    and for block-quantized types rows of bytes (`gguf.quant_shape_to_byte_shape`)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buffer: memoryview):
        self.buffer = buffer
        self.at = 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> bytes:
        length = self.take("<Q")
        text = bytes(self.buffer[self.at:self.at + length])
        self.at += length
        return text

    def skip_value(self, kind: int) -> None:
        if kind in _FIXED:
            self.at += _FIXED[kind]
        elif kind == _STRING:
            self.at += 8 + struct.unpack_from("<Q", self.buffer, self.at)[0]
        elif kind == _ARRAY:
            item, count = self.take("<IQ")
            if item in _FIXED:
                self.at += _FIXED[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown GGUF metadata value type {kind} at byte {self.at}")


def read_tensors(path: str | os.PathLike) -> list[GGUFTensor]:
    """The tensors of the GGUF file at `path`, in file order (ValueError for a file that is not
    a GGUF)."""
    import gguf  # the type tables: imported here, as only GGUF loading needs the package

    path = os.fspath(path)
    mapped = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(mapped))
    if bytes(cursor.buffer[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with {_MAGIC!r})")
    cursor.at = 4
    version = cursor.take("<I")
    if version not in _VERSIONS:  # another version, or a big-endian file: the package knows more
        return [GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data)
                for t in gguf.GGUFReader(path).tensors]
    n_tensors, n_values = cursor.take("<QQ")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(n_values):
        key = cursor.string()
        kind = cursor.take("<I")
        if key == _ALIGNMENT_KEY and kind == 4:
            alignment = cursor.take("<I")
        else:
            cursor.skip_value(kind)
    infos = []
    for _ in range(n_tensors):
        name = cursor.string().decode("utf-8")
        n_dims = cursor.take("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", cursor.buffer, cursor.at)
        cursor.at += 8 * n_dims
        raw_type, offset = cursor.take("<IQ")
        infos.append((name, dims, raw_type, offset))
    start = -(-cursor.at // alignment) * alignment
    return [_tensor(gguf, mapped, start, *info) for info in infos]


_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


def _tensor(gguf, mapped: np.memmap, start: int, name: str, dims: tuple[int, ...], raw_type: int,
            offset: int) -> GGUFTensor:
    kind = gguf.GGMLQuantizationType(raw_type)
    count = int(np.prod(dims))
    np_dims = tuple(reversed(dims))
    begin = start + offset
    item = _TYPED.get(kind.name)
    if item is not None:
        data = mapped[begin:begin + count * np.dtype(item).itemsize].view(item).reshape(np_dims)
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = count * type_size // block_size
        data = mapped[begin:begin + n_bytes].reshape(gguf.quant_shape_to_byte_shape(np_dims, kind))
    return GGUFTensor(name, kind, tuple(int(d) for d in dims), data)
