"""Tensor parallelism: one model split across several processes (devices) on torch.distributed.

`sharding` says how dimensions split, `group` is a rank's view of its peers for the model's
collectives, `launch` starts and joins the processes, `step_protocol` carries each step from rank
0 to the others, `worker` is the other ranks' loop, `supervisor` and `driver` are rank 0's side
(watching the workers, and the runner the engine drives).
"""
