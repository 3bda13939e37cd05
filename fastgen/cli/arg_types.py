"""argparse `type=` converters: each turns one flag's text into a checked value.

They raise `argparse.ArgumentTypeError`, which argparse turns into
`fastgen ...: error: argument --flag: <message>` and exit status 2, so every message names the
flag (argparse adds it), the value and the limit.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from fastgen.bench.workload import IntRange

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(convert, text: str, expected: str):
    """convert(text); a ValueError becomes the message argparse prints: the value and what it must be."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be {expected}") from None


def integer(text: str) -> int:
    """Any integer (the field's own check sets the limits)."""
    return _parse(int, text, "an integer")


def int_at_least(minimum: int, below: int | None = None):
    """Converter for integers >= minimum (and < below, when given)."""

    def convert(text: str) -> int:
        value = integer(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be >= {minimum}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be < {below}")
        return value

    convert.__name__ = f"integer >= {minimum}"  # what argparse prints for a failed conversion
    return convert


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def number(text: str) -> float:
    return _parse(float, text, "a number")


def int_list(text: str) -> list[int]:
    """Comma-separated integers: `1,2,4,8`."""
    return _parse(lambda t: [int(part) for part in t.split(",")], text, "comma-separated integers")


def non_negative_float(text: str) -> float:
    value = number(text)
    if not value >= 0.0 or math.isinf(value):  # the first also rejects nan
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a finite number >= 0")
    return value


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0.0 or math.isinf(value):  # the first also rejects nan
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a finite number > 0")
    return value


def rate(text: str) -> float:
    """Events per second: a finite number > 0, or inf (no waiting at all)."""
    value = number(text)
    if not value > 0.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a number > 0, or inf")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1], such as a share of GPU memory or a top-p mass."""
    value = _parse(float, text, "a number in (0, 1]")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be in (0, 1]")
    return value


def top_k(text: str) -> int:
    value = integer(text)
    if value == 0 or value < -1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be -1 (all tokens) or >= 1")
    return value


def byte_size(text: str) -> int:
    """A size in bytes: `1073741824`, `4GiB`, `512MiB`, `1.5GB`, `2e9` (decimal and binary units)."""
    match = _BYTES_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: must be a size such as 1073741824, 4GiB, 512MiB or 2GB"
        )
    number = float(match.group(1))
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: too large a size")
    value = int(number * _BYTE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be at least 1 byte")
    return value


def output_path(text: str) -> str:
    """A file to write at the end of a run: checked now, so a long benchmark never ends in an
    unwritable path. '-' means stdout; a missing parent folder is created when writing."""
    if text == "-":
        return text
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: is a directory, not a file path")
    existing = next(p for p in [path.parent, *path.parent.parents] if p.exists()) if path.parent.parts else Path(".")
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not writable")
    return text


def int_range(minimum: int):
    """Converter for `N` or `MIN:MAX` (inclusive), every bound >= minimum and MIN <= MAX."""

    def convert(text: str) -> IntRange:
        parts = text.split(":")
        if len(parts) > 2 or not all(p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be N or MIN:MAX")
        bounds = _parse(lambda _: [int(p) for p in parts], text, "N or MIN:MAX with integer bounds")
        low, high = bounds[0], bounds[-1]
        if low < minimum:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {low} must be >= {minimum}")
        if low > high:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: MIN {low} must be <= MAX {high}")
        return IntRange(low, high)

    convert.__name__ = "N or MIN:MAX"
    return convert


def existing_file(text: str) -> Path:
    """A file to read (a JSON schema, a grammar): it must exist and be readable now."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: no such file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not readable")
    return path


def json_object(text: str) -> dict:
    """A JSON object ({"method": "ngram", ...})."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object")
    return value
