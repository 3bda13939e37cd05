"""fastgen: a small, fast LLM inference engine (paged KV cache, prefix caching, continuous
batching, CUDA graphs for decode).

The public API is imported lazily, on first attribute access, so that `import fastgen` (and
`fastgen --help`) does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "fastgen.llm",
    "SamplingParams": "fastgen.sampling_params",
    "StructuredOutputsParams": "fastgen.structured_outputs_params",
    "RequestOutput": "fastgen.outputs",
    "RequestMetrics": "fastgen.outputs",
    "CompletionOutput": "fastgen.outputs",
    "Logprob": "fastgen.outputs",
    "EngineConfig": "fastgen.config",
    "EngineDeadError": "fastgen.errors",
    "LLMEngine": "fastgen.engine.llm_engine",
    "BackgroundEngine": "fastgen.engine.background",
    "RequestStream": "fastgen.engine.background",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastgen' has no attribute {name!r}")


class _SourceTreeKernels(importlib.abc.MetaPathFinder):
    """Finds `fastgen.kernels` in the repository's top-level `kernels/` folder.

    A built wheel installs that folder as `fastgen/kernels` (setuptools `package-dir`), so
    nothing named `kernels` lands in site-packages beside Hugging Face's `kernels` package. Run
    from a source checkout (tests, the GPU check, an editable install) the folder sits beside
    the package instead; this finder maps the name there. It goes first in `sys.meta_path` so
    that a checkout imported from its own directory never picks up another checkout's kernels.
    """

    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "fastgen.kernels":
            return None
        return importlib.util.spec_from_file_location(
            fullname, self.folder / "__init__.py", submodule_search_locations=[str(self.folder)]
        )


_package = Path(__file__).resolve().parent
if not (_package / "kernels").is_dir() and (_package.parent / "kernels" / "__init__.py").is_file():
    sys.meta_path.insert(0, _SourceTreeKernels(_package.parent / "kernels"))
