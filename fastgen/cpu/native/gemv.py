"""Linear layers as Inductor reductions, for the batch-1 CPU decode step.

At one row a linear layer is a matrix-vector product: every weight is read once for two flops,
so its speed is the memory bandwidth. On a 2-core AMD EPYC, oneDNN's bf16 GEMM streamed a
whole model's weights at 10-18 GB/s with one row (23-27 GB/s with pre-packed weights), while the
same product written as an element-wise multiply and a row sum, `(x[:, None, :] * W).sum(-1)`,
became vectorised Inductor reductions that streamed at 28-34 GB/s, the machine's bandwidth.
Each reduction reads its input from a buffer of its own (see `gemv_linear`): with the input's
RMSNorm recomputed for every weight row, the row loop was bound by arithmetic, and the whole
step took 8.9-10.2 ms instead of 6.9-8.1 ms (SmolLM2-135M, bf16). With
more rows the GEMM wins (it reuses each weight across rows: at four rows the reductions were
already 1.4x slower), so only the one-row step is rewritten.

The arithmetic is the GEMM's: products and sums in float32, one rounding to the output dtype at
the end (bias included), only the order of the additions differs.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._inductor import inductor_prims


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K], as a multiply and a row sum."""
    # The input is made a buffer of its own: left alone, Inductor inlines the RMSNorm that
    # produced it into the row loop and recomputes it for every one of the N rows.
    xf = x.float()
    xf = inductor_prims.force_stride_order(xf, xf.stride())
    out = (xf.unsqueeze(-2) * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# How a linear layer's call appears in a Dynamo graph (also what `packed_linear` rewrites).
LINEAR_CALLS = {torch._C._nn.linear, torch.nn.functional.linear}


def linears_as_gemv(gm: torch.fx.GraphModule) -> int:
    """Rewrite every linear call of a Dynamo graph into `gemv_linear`, in place; returns how many.

    Runs on the graph Dynamo hands its backend (torch-level calls, before AOTAutograd), so
    Inductor sees the reduction and fuses it with its neighbours."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in LINEAR_CALLS:
            node.target = gemv_linear
            count += 1
    gm.recompile()
    return count
