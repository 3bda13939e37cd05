"""torch.compile for the small element-wise pieces of the model and the sampler.

`build_op_set(compiled)` returns the set of functions the model and sampler call (the sampler's
arithmetic is `sampling_ops`); the model never asks whether they were compiled. One switch
(`EngineConfig.use_torch_compile`) turns it off.
"""

from fastgen.compile.op_set import OpSet, build_op_set

__all__ = ["OpSet", "build_op_set"]
