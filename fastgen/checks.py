"""Value checks shared by every boundary (`SamplingParams`, `EngineConfig`, `LLM`, config.json).

Each raises ValueError naming the field, the value and the limit, and returns the value as a
plain Python bool / int / float, so that what passes is exactly what the engine will use (a
numpy scalar or an int subclass never travels further in).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers

# The sampler computes in float32: a number beyond this is infinite there.
FLOAT32_MAX = 3.4028234663852886e38


def boolean(name: str, value: object) -> bool:
    """True or False only: "no", 0, 1 and None are refused (a non-empty string is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def integer(name: str, value: object, minimum: int | None = None, below: int | None = None,
            below_text: str | None = None) -> int:
    """An integer (numpy integers too, never a bool) in [minimum, below)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer" + (f" >= {minimum}" if minimum is not None else ""))
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    if below is not None and value >= below:
        raise ValueError(f"{name}={value} must be < {below_text or below}")
    return value


def real(name: str, value: object, limit_text: str, low: float, high: float = FLOAT32_MAX,
         low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] with low_open); `limit_text` describes the range
    in the message. Integers too large for a float are refused, not an OverflowError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be {limit_text}")
    try:
        number = float(value)
    except (OverflowError, ValueError):
        number = math.inf
    if not math.isfinite(number) or number < low or number > high or (low_open and number == low):
        raise ValueError(f"{name}={value!r} must be {limit_text}")
    return number


def positive_real(name: str, value: object) -> float:
    """A finite number > 0 (an epsilon, a timeout, a RoPE factor)."""
    return real(name, value, "a finite number > 0", low=0.0, high=math.inf, low_open=True)


def known_fields(cls: type, given: dict, what: str) -> None:
    """ValueError naming the keywords of `given` that dataclass `cls` has no field for (Python
    would raise a TypeError from inside the generated __init__)."""
    known = _init_fields(cls)
    if not known.keys() >= given.keys():
        raise ValueError(f"{what} has no field(s) {sorted(given.keys() - known.keys())}; known: {list(known)}")


@functools.cache
def _init_fields(cls: type) -> dict[str, None]:
    return {f.name: None for f in dataclasses.fields(cls) if f.init}


def keep_signature(cls: type) -> type:
    """For a dataclass whose `__new__` checks its keywords: its signature is its __init__'s
    fields again (help() and signature-reading tools would otherwise see `*args, **kwargs`)."""
    init = inspect.signature(cls.__init__)
    cls.__signature__ = init.replace(parameters=list(init.parameters.values())[1:])
    return cls
