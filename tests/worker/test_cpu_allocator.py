"""The CPU allocator tuning: a freed activation-sized block stays in glibc's heap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc's malloc"
)

# A fresh process (no earlier tuning, no torch): malloc and free an 8 MiB block, tuned or not,
# and print how many new blocks glibc served from mmap, which a free hands back to the kernel.
PROBE = """
import ctypes, sys
from fastgen.worker.cpu_allocator import keep_freed_memory

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
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    tuned, mapped = out.stdout.split()
    return tuned, int(mapped)


@glibc_only
def test_tuned_heap_serves_activation_blocks_without_mmap():
    assert probe("plain") == ("False", 1)  # glibc's default: an 8 MiB block is its own mapping
    assert probe("tuned") == ("True", 0)


@glibc_only
def test_user_allocator_settings_are_left_alone():
    assert probe("tuned", MALLOC_MMAP_THRESHOLD_="131072") == ("False", 1)
