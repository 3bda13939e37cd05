"""C++ sources of fastgen built once per machine into shared libraries, loaded with ctypes.

A hand-written CPU kernel (e.g. `fastgen/cpu/native/decode_attention.cpp`, with the headers
beside it) is plain C++ with a C entry point, or (`fastgen/cpu/native/packed_linear_op.cpp`) uses
only torch's stable C ABI headers: either builds in one to five seconds with the C++ compiler
Inductor uses anyway, and needs no build step at install time (`build_in_background` starts the
builds while a model converts or loads). It is built with `-march=native`, so the library's name
carries a digest of the source, the compiler, the flags, the CPU's feature flags and torch's
version: a cache folder shared between different machines never hands one of them code for
another's instruction set.

Where there is no compiler (or the build fails) `load_native_library` returns None, once logged;
every caller keeps a torch path for that case.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from fastgen.cpu.native.features import cpu_flags
from fastgen.paths import cache_dir

logger = logging.getLogger(__name__)

# Never -ffast-math: linked into a shared library it sets flush-to-zero and denormals-are-zero
# for the whole process at load time (crtfastmath), which changes every other float op in it.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-shared", "-fPIC")


def compiler() -> str | None:
    """$CXX, else the first of g++, c++, clang++ on PATH."""
    if explicit := os.environ.get("CXX"):
        return explicit
    return next((path for name in ("g++", "c++", "clang++") if (path := shutil.which(name))), None)


def torch_abi_flags() -> tuple[str, ...]:
    """Flags for a source that uses torch's stable C ABI (`torch/csrc/stable`): its headers, and
    the libraries that export it (torch's version goes into every library's digest)."""
    root = Path(torch.__file__).parent
    return (f"-I{root / 'include'}", f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-ltorch_cpu", "-lc10")


# One lock a library: a background build (`build_in_background`) and a first use wait for each
# other instead of compiling the same source twice.
_build_locks: dict[Path, threading.Lock] = {}
_build_locks_guard = threading.Lock()


def _forget_build_locks() -> None:
    # A child forked while a build held its lock would wait on it for ever: it starts with none.
    global _build_locks, _build_locks_guard
    _build_locks, _build_locks_guard = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_build_locks)


def _built_library(source: Path, extra_flags: tuple[str, ...], root: Path | None = None) -> Path:
    """The path of `source`'s library for this machine under `root` (default: fastgen's cache
    folder), built first if it is not there. Raises OSError / subprocess errors when it cannot
    be built; the caller reports them."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler found (set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    # The headers beside the source are in the digest too: any of them may be included.
    texts = [path.read_text() for path in (source, *sorted(source.parent.glob("*.h")))]
    digest = hashlib.sha256("\n".join([*texts, cxx, version, " ".join(FLAGS + extra_flags), platform.machine(),
                                       " ".join(sorted(cpu_flags())), torch.__version__]).encode()).hexdigest()[:16]
    target = (root or cache_dir()) / "native" / f"{source.stem}-{digest}.so"
    with _build_locks_guard:
        lock = _build_locks.setdefault(target, threading.Lock())
    with lock:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # Built beside the target and renamed into place: a concurrent process never loads
            # a half-written library.
            fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                subprocess.run([cxx, *FLAGS, str(source), "-o", partial, *extra_flags], check=True,
                               capture_output=True, text=True, timeout=600)
                os.replace(partial, target)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
            logger.info("built %s into %s", source.name, target)
    return target


def build_in_background(source: Path, extra_flags: tuple[str, ...] = (), root: Path | None = None
                        ) -> threading.Thread:
    """Start building `source`'s library in a thread (a no-op where it is cached): the compiler
    is a process of its own, so the build runs beside whatever this process does meanwhile
    (converting or loading a model), and the first use then only loads it. The cache folder is
    the one of the moment of the call (`root`, default `cache_dir()`), whenever the thread gets
    to it. A build that fails here is left to that first use, which reports it."""
    root = root or cache_dir()
    thread = threading.Thread(target=build_quietly, args=(source, extra_flags, root), name=f"build {source.name}",
                              daemon=True)
    thread.start()
    return thread


def build_quietly(source: Path, extra_flags: tuple[str, ...] = (), root: Path | None = None) -> None:
    """Build `source`'s library under `root` if it is not there, saying nothing of a failure:
    the first use builds it again and reports why (for builds ahead of that use)."""
    try:
        _built_library(source, extra_flags, root)
    except (OSError, subprocess.SubprocessError):
        pass


@functools.cache
def load_native_library(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The shared library built from the C++ file `source` (built and cached under fastgen's
    cache folder on first use), or None where it cannot be built or loaded. `extra_flags` go on
    the compiler's command line after the common ones (e.g. `torch_abi_flags()`)."""
    cxx = compiler()
    if cxx is None:
        logger.warning("no C++ compiler found (set CXX); %s is not built, its torch fallback runs", source.name)
        return None
    try:
        return ctypes.CDLL(str(_built_library(source, extra_flags)))
    except subprocess.CalledProcessError as exc:
        logger.warning("could not build %s (%s); its torch fallback runs:\n%s", source.name, cxx, exc.stderr)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("could not build or load %s (%s: %s); its torch fallback runs", source.name,
                       type(exc).__name__, exc)
    return None
