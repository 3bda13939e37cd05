"""Tensor parallelism: one model split across several processes (devices) on torch.distributed.

How weights split and the model's collectives are `fastgen.parallel`, below the model; here,
above the runner: `launch` starts and joins the processes, `step_protocol` carries each step
from rank 0 to the others, `worker` is the other ranks' loop, `supervisor` and `rank0_runner`
are rank 0's side (watching the workers, and the runner the engine drives).
"""
