"""What a quantized weight is: codes, per-group scales and (optionally) per-group minimums.

A weight [N, K] is cut along K into groups of `group_size` consecutive inputs; each output row's
group has its own scale (and, where `has_mins`, its own minimum), stored as float16 as llama.cpp
stores them (GGUF files load without a conversion):

- 8 bits: int8 codes [N, K], w = code * scale. `int8` uses one group per row (per output
  channel); GGUF's Q8_0 groups of 32.
- 4 bits: two codes a byte, uint8 [N, K / 2]. Within a group of G inputs, byte j holds input j in
  its low nibble and input j + G/2 in its high one (GGUF's block order, so a Q4_0 / Q4_1 block is
  copied as it is). Without minimums w = (code - 8) * scale (symmetric, as Q4_0); with them
  w = code * scale + min (as Q4_1).
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("int8", "int4")
DEFAULT_INT4_GROUP_SIZE = 32


@dataclass(frozen=True)
class QuantFormat:
    bits: int
    group_size: int
    has_mins: bool = False

    def __post_init__(self) -> None:
        assert self.bits in (4, 8) and self.group_size >= 1, self
        assert self.bits == 8 or self.group_size % 2 == 0, "4-bit groups pair inputs into bytes"


def group_size_fits(group_size: int, in_features: int, bits: int) -> bool:
    """Whether `group_size` divides a weight's input width (and is even at 4 bits)."""
    return in_features % group_size == 0 and (bits != 4 or group_size % 2 == 0)


def check_group_size(name: str, group_size: int, in_features: int, bits: int) -> None:
    """ValueError unless `group_size` divides the weight's input width (and is even at 4 bits)."""
    if not group_size_fits(group_size, in_features, bits):
        even = ", and even for 4-bit codes" if bits == 4 else ""
        raise ValueError(f"quantization_group_size={group_size} does not fit {name}: it must divide its "
                         f"{in_features} inputs{even}")


def check_group_size_fits(method: str, group_size: int | None, widths: dict[str, int]) -> None:
    """ValueError, before any weight loads, where `method`'s group size (the one asked for, or
    int4's default) does not divide an input width of the model's linear layers (`widths`: what
    feeds them -> its width on one rank), naming the size, where it came from, and the width."""
    if method not in METHODS:
        return
    size = group_size or (DEFAULT_INT4_GROUP_SIZE if method == "int4" else None)
    if size is None:
        return  # int8 without groups: one scale per output row, any width
    for what, width in widths.items():
        if not group_size_fits(size, width, 4 if method == "int4" else 8):
            given = f"quantization_group_size={size}" if group_size else \
                f"quantization={method!r} groups {size} inputs by default (quantization_group_size)"
            even = ", and even for 4-bit codes" if method == "int4" else ""
            raise ValueError(f"{given} does not fit the model: it must divide {what} of {width} inputs{even}; "
                             "pick a group size that divides them")


def linear_format(method: str, group_size: int | None, in_features: int, name: str) -> QuantFormat:
    """The format `method` gives a linear layer's weight of `in_features` inputs."""
    if method == "int8":
        size = group_size or in_features
        check_group_size(name, size, in_features, 8)
        return QuantFormat(8, size)
    if method == "int4":
        size = group_size or DEFAULT_INT4_GROUP_SIZE
        check_group_size(name, size, in_features, 4)
        return QuantFormat(4, size, has_mins=True)
    raise ValueError(f"quantization={method!r} is not one of {list(METHODS)}")
