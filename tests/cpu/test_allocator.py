"""The CPU allocator tuning: a freed activation-sized block stays in glibc's heap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def glibc_version() -> tuple[int, ...]:
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"
    except (ValueError, OSError):
        return ()
    return tuple(int(part) for part in name.split()[-1].split(".")) if name.startswith("glibc") else ()


# mallinfo2, which the probe reads, came with glibc 2.33.
glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or glibc_version() < (2, 33),
                                reason="glibc 2.33 or later")
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

# A fresh process (no earlier tuning, no torch): malloc and free an 8 MiB block, tuned or not,
# and print how many new blocks glibc served from mmap, which a free hands back to the kernel.
PROBE = """
import ctypes, sys
from fastgen.cpu.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = MallInfo2
tuned = keep_freed_memory() if sys.argv[1] == "tuned" else False
before = libc.mallinfo2().hblks
block = libc.malloc(8 * 2**20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(tuned, mapped)
"""


def probe(mode: str, **env) -> tuple[str, int]:
    """Run PROBE with glibc's allocator variables taken from `env` only, not inherited."""
    inherited = {name: value for name, value in os.environ.items() if name not in ALLOCATOR_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**inherited, **env})
    tuned, mapped = out.stdout.split()
    return tuned, int(mapped)


@glibc_only
def test_tuned_heap_serves_activation_blocks_without_mmap():
    assert probe("plain") == ("False", 1)  # glibc's default: an 8 MiB block is its own mapping
    assert probe("tuned") == ("True", 0)


@glibc_only
def test_user_allocator_settings_are_left_alone():
    assert probe("tuned", MALLOC_MMAP_THRESHOLD_="131072") == ("False", 1)
    assert probe("tuned", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072") == ("False", 1)
    assert probe("tuned", GLIBC_TUNABLES="glibc.rtld.optional_static_tls=2048") == ("True", 0)  # not malloc's
