"""Reading config.json keys, each one checked: a missing or malformed key is a ValueError naming
the file, the key, the value and what was expected (never a KeyError or a TypeError later)."""

from __future__ import annotations

from fastgen.checks import boolean, integer, positive_real

_REQUIRED = object()
# RoPE variants the rotary layer implements, with the numeric keys each needs.
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


class ConfigKeys:
    """raw: the parsed config.json; where: its path, for messages."""

    def __init__(self, raw: object, where: str):
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must hold a JSON object, got {type(raw).__name__}")
        self.raw = raw
        self.where = where

    def _get(self, key: str, default):
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"{self.where} has no {key!r}, which the engine needs")
            return default
        return value

    def _checked(self, check, key: str, value, *args, **kwargs):
        try:
            return check(key, value, *args, **kwargs)
        except ValueError as exc:
            raise ValueError(f"{self.where}: {exc}") from None

    def positive_int(self, key: str, default=_REQUIRED) -> int:
        """A key that must be an integer >= 1 (null or absent: the default)."""
        return self._checked(integer, key, self._get(key, default), minimum=1)

    def positive_number(self, key: str, default=_REQUIRED) -> float:
        return self._positive(key, self._get(key, default))

    def _positive(self, name: str, value) -> float:
        return self._checked(positive_real, name, value)

    def flag(self, key: str, default: bool) -> bool:
        return self._checked(boolean, key, self._get(key, default))

    def token_ids(self, key: str) -> tuple[int, ...]:
        """An id, a list of ids, or null."""
        value = self._get(key, None)
        values = value if isinstance(value, list) else ([] if value is None else [value])
        return tuple(self._checked(integer, key, v, minimum=0) for v in values)

    def string(self, key: str, choices, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or value.removeprefix("torch.") not in choices:
            raise ValueError(f"{self.where}: {key}={value!r} is not one of {sorted(choices)}")
        return value.removeprefix("torch.")

    def rope(self) -> tuple[dict, str]:
        """The RoPE parameters and their type, read as transformers reads them: the older
        rope_scaling over rope_parameters where both are given; a rope_theta inside them over
        the top-level one (10,000 where neither is); for llama3, a top-level
        original_max_position_embeddings over the one inside (Phi-3's placement), and
        max_position_embeddings where neither is."""
        raw = self.raw
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{self.where}: rope_parameters / rope_scaling={rope!r} must be an object")
        rope = dict(rope)
        kind = rope.get("rope_type", rope.get("type")) or "default"
        if not isinstance(kind, str) or kind not in ROPE_TYPES:
            raise ValueError(f"{self.where}: rope type {kind!r} (rope_scaling / rope_parameters) is not supported; "
                             f"supported: {sorted(ROPE_TYPES)}")
        # Rotating part of each head: transformers' scaled RoPE types honour it (and then fail on
        # these families, whose attention rotates whole heads); fastgen rotates whole heads only.
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if kind != "default" and partial not in (1, 1.0, None):
            raise ValueError(f"{self.where}: partial_rotary_factor={partial!r} is not supported with {kind!r} RoPE: "
                             "fastgen rotates whole heads (1.0)")
        top_level_theta = self.positive_number("rope_theta", 10000.0)  # checked even where unused
        if rope.get("rope_theta") is None:
            rope["rope_theta"] = top_level_theta
        if kind == "llama3":
            if raw.get("original_max_position_embeddings") is not None:
                rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
            elif rope.get("original_max_position_embeddings") is None:
                rope["original_max_position_embeddings"] = self.positive_int("max_position_embeddings", 2048)
        for key in ("rope_theta", *ROPE_TYPES[kind]):
            if key not in rope:
                raise ValueError(f"{self.where}: {kind!r} RoPE scaling has no {key!r}")
            self._positive(f"rope {key}", rope[key])
        if kind == "llama3" and not rope["high_freq_factor"] > rope["low_freq_factor"]:
            raise ValueError(f"{self.where}: llama3 RoPE high_freq_factor={rope['high_freq_factor']!r} must be "
                             f"> low_freq_factor={rope['low_freq_factor']!r}")
        return rope, kind
