"""Compiled graphs kept on disk: traced and compiled once, loaded by every later process.

torch.compile's own caches keep Inductor's output, but a new process still has Dynamo trace the
Python again before it can look them up: about 20 seconds for a 30-layer decode step on two
cores. `torch.compile(...).aot_compile` instead packages the traced bytecode and the compiled code
together; loading that package takes a few seconds and traces nothing.

A package is only valid for the exact code and shapes it was traced from, and it is called with
its guards off (they would reject an input made under another autograd mode, and checking
hundreds of tensors costs about a millisecond a step). So everything a trace depends on goes into
the file's name instead (`graph_key`): the fastgen source it traces, torch, Python, the CPU's vector
capability and feature flags (a cache shared between machines must not hand an AMX graph to a CPU
without AMX), the thread count, the model's configuration and the shapes and dtypes of every
parameter and static tensor. A package whose key matches was traced from the same program over
the same fixed shapes (every other size is a symbol of its own: no duck shaping); any change
makes a new key and so a new compile.

So every fastgen or torch upgrade leaves the old packages (5-10 MB each) behind: a package is
marked used (its modification time) whenever it is loaded or saved, and packages of its kind
beside it left unused for `UNUSED_DAYS` are deleted then.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fastgen.cpu.native.features import cpu_flags
from fastgen.cpu.step_threads import STEP_THREADS
from fastgen.paths import cache_dir

logger = logging.getLogger(__name__)

UNUSED_DAYS = 30


# The packages whose code a compiled step runs or builds it from: the model and its layers,
# attention, the op set, the CPU fast path, how weights split and how they are quantized; and
# `fastgen.kernels` (the KV store's torch twin). The engine, the server and the CLI change
# without changing any graph, so they stay out of its key (`tests/cpu/test_compile_modes.py`
# checks that every file a trace runs is in here).
TRACED_PACKAGES = ("models", "layers", "attention", "compile", "cpu", "parallel", "quantization")

# Bumped when code outside those packages changes what a graph may assume of its inputs (2: block
# tables are at least two columns wide, so no graph holds their width as a constant).
INPUT_CONTRACT = 2


def traced_sources() -> list[Path]:
    """The Python files a compiled step's key covers, sorted."""
    import fastgen.kernels

    root = Path(fastgen.__file__).parent
    paths = [path for package in TRACED_PACKAGES for path in (root / package).rglob("*.py")]
    paths += Path(fastgen.kernels.__file__).parent.glob("*.py")
    return sorted(path.resolve() for path in paths)


@functools.cache
def source_digest() -> str:
    """A digest of the code the compiled steps trace (`traced_sources`)."""
    digest = hashlib.sha256()
    for path in traced_sources():
        digest.update(f"{path.parent.name}/{path.name}".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def graph_key(name: str, model: torch.nn.Module, model_config: object, static: Sequence[torch.Tensor]) -> str:
    """What a graph's trace depends on, hashed: its name, the program, the model's configuration
    (its floats become constants of the graph) and the shapes of the tensors it sees."""
    from torch._inductor import config as inductor_config

    # The thread count is written into Inductor's C++ (its OpenMP loops), so it is part of the key
    # too: Inductor's own setting, else the steps' count with no background child compiling
    # (`STEP_THREADS`), which a compile in this process then runs with.
    threads = inductor_config.cpp.threads if inductor_config.cpp.threads > 0 else STEP_THREADS.full_threads()
    parts = [name, f"inputs {INPUT_CONTRACT}", source_digest(), torch.__version__, platform.python_version(),
             sys.platform, torch.backends.cpu.get_cpu_capability(), " ".join(sorted(cpu_flags())),
             f"threads {threads}", repr(model_config)]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in model.named_buffers()]
    parts += [f"static:{tuple(t.shape)}:{t.dtype}" for t in static]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def load_or_compile(fn: Callable, backend: Callable, args: tuple, model: torch.nn.Module, path: Path,
                    ) -> tuple[Callable, bool]:
    """`fn(model, *args)` compiled whole (one graph, symbolic sizes) with `backend`: loaded from
    `path` when a package is there, else compiled and saved there. Returns the compiled function
    (same arguments as `fn`) and whether it was loaded."""
    # Inductor's default, a folder under /tmp, is often wiped at boot; keep its caches with
    # fastgen's other cached artefacts unless the user chose a place. Inductor reads its folder
    # from this variable (and writes its default there itself): there is no per-compile setting.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    if path.exists():
        try:
            with open(path, "rb") as f:
                compiled = torch.compiler.load_compiled_function(f, external_data={"model": model})
            compiled.disable_guard_check()
        except Exception as exc:  # a package of another torch, truncated or corrupt: compile anew
            logger.warning("could not load the compiled graph %s (%s: %s); compiling it again", path,
                           type(exc).__name__, exc)
        else:
            mark_used_and_prune(path)
            return compiled, True
    # Floats of the model (norm epsilon, RoPE base, attention scale) and the code's ints (the
    # flat weights' offsets and shapes: `fastgen.cpu.flat_weights`) stay constants: the key
    # covers them, an AOT trace cannot restart when one would otherwise become an input, and
    # each symbolic int would be one more input to fetch on every call. Sizes stay symbolic:
    # they are read from tensors, which `dynamic=True` covers.
    # No duck shaping: sizes that happen to be equal in the example (4 rows attending to 4
    # tokens) must stay separate symbols, or the graph would assume them equal for ever, and
    # with its guards off nothing would notice.
    with torch._dynamo.config.patch(specialize_float=True, specialize_int=True), \
            torch.fx.experimental._config.patch(use_duck_shape=False):
        compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True).aot_compile(((model, *args), {}))
    compiled.disable_guard_check()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        compiled.save_compiled_function(str(path), external_data={"model": model})  # written atomically
        logger.debug("saved %s in %.2fs", path, time.perf_counter() - start)
    except Exception as exc:  # a read-only cache, or a graph that does not serialise: keep it in memory
        logger.warning("could not save the compiled graph to %s (%s: %s)", path, type(exc).__name__, exc)
    else:
        mark_used_and_prune(path)
    return compiled, False


def mark_used_and_prune(path: Path) -> None:
    """Mark the package at `path` used now, and delete the packages of its kind beside it (same
    name prefix: `decode-*.pt`) that no process has loaded or saved for `UNUSED_DAYS`."""
    now = time.time()
    try:
        os.utime(path, (now, now))
    except OSError:
        pass
    kind = path.name.split("-", 1)[0]
    for other in path.parent.glob(f"{kind}-*.pt"):
        try:
            if other != path and now - other.stat().st_mtime > UNUSED_DAYS * 86400:
                other.unlink()
                logger.info("removed the compiled graph %s, unused for %d days", other, UNUSED_DAYS)
        except OSError:  # removed meanwhile by another process, or not ours to remove
            pass
