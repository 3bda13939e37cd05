"""What this machine's CPU can do, read once from /proc/cpuinfo (Linux; elsewhere: nothing)."""

from __future__ import annotations

import functools

# Instruction sets with bf16 dot products: oneDNN runs bf16 GEMMs on them at several times the
# float32 rate. Without them torch emulates bf16 and float32 is faster.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model_name() -> str | None:
    """The first CPU's model name ("AMD EPYC ..."), or None where /proc/cpuinfo is missing."""
    return _cpuinfo_field("model name")


def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags ("Features" on Arm; empty where /proc/cpuinfo is missing)."""
    return frozenset((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())


def has_native_bf16() -> bool:
    """True when the CPU computes bf16 dot products natively (AVX-512 BF16 or AMX)."""
    return bool(cpu_flags() & NATIVE_BF16_FLAGS)
