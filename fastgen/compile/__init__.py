"""torch.compile for the small fused pieces of the model and the sampler.

`build_ops(enabled)` returns the set of functions the model and sampler call; the model never
asks whether they were compiled. One switch (`EngineConfig.use_torch_compile`) turns it off.
"""

from fastgen.compile.registry import FusedOps, build_ops

__all__ = ["FusedOps", "build_ops"]
