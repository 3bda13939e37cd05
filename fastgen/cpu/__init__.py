"""The CPU fast path, all of it: what makes a CPU step fast once compiled, and the map of it.

Two layers, so that the attention backend below can use the native kernels while the compiled
steps above use the model:

`fastgen.cpu.native` (below `attention`; C++ and the torch code that calls it, nothing of the model)
    library.py          C++ sources built once per machine (`-march=native`, with the compiler
                        Inductor uses anyway) into shared libraries under the cache, loaded with
                        ctypes; no compiler or a failed build gives None, logged once, and every
                        caller keeps a torch path.
    decode_attention    paged decode attention over the KV cache in C++ (`.cpp` + `.py`, a torch
                        op; its K and V passes in `decode_attention_passes.h`, the vector
                        helpers in `simd16.h`); falls back to `torch_decode`.
    torch_decode.py     the same attention in torch, for shapes the kernel has no instance for.
    gemm                fastgen's bf16 GEMM for CPUs with AVX-512 BF16 and without AMX.
    packed_linear       linear weights packed once for that GEMM (or oneDNN where AMX runs), and
                        the `fastgen::packed_linear` op the compiled graphs call (its C++ kernel in
                        `packed_linear_op.cpp`, on torch's stable C ABI; a Python kernel otherwise).
    quantized_linear    the `fastgen::quantized_linear` op's CPU kernels (`quantized_linear_op.cpp`:
                        a GEMV over int8 / 4-bit codes, bf16 rows rounded to int8 where the CPU
                        has VNNI; for many rows (`gemm_rows`) `gemm.cpp`'s quantized GEMM over
                        panels dequantized into cache, from twins packed here).
    features.py         what the CPU can do (/proc/cpuinfo, read once): native bf16, AMX.
    openmp.py           a thread's OpenMP workers handed back, so that the thread running the
                        steps (a background loop, an application's pool thread) has the CPUs
                        to itself (`DrivingThreads`: which thread drives an `LLM`).

`fastgen.cpu` (above `worker`: whole steps over the model)
    compiled_decode.py  the step compiled, the same graphs for prefill and decode: the CPU
                        counterpart of the decode CUDA graphs. `ModelRunner` builds it when
                        `EngineConfig.compiled_decode_enabled`; a step it cannot run (a slot of
                        -1, prompt logprobs, a failed build) runs eagerly.
    layer_groups.py     the layers cut into equal groups: one compiled group runs every group,
                        then a small graph ends the step, so a compile walks a third of the model.
    saved_graphs.py     compiled graphs packaged on disk, so a later process loads instead of
                        tracing and compiling again.
    flat_weights.py     the weights as one buffer per dtype, so a compiled call takes few inputs.
    background_compile.py  the child processes that compile graphs: in the background while
                        the engine serves eagerly, or as helpers of a blocking engine.
    step_threads.py     the steps' thread count while such a child compiles: one fewer, so
                        that it has a core of its own.
    allocator.py        glibc kept from handing freed activation memory back between ops.

What falls back to what: compiled step -> eager forward; C++ attention -> torch attention;
fastgen's GEMM -> oneDNN -> plain `F.linear`; quantized GEMM -> quantized GEMV -> dequantize
and multiply; no C++ compiler -> every torch path.
"""
