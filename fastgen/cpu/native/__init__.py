"""fastgen's native CPU kernels (C++ built on first use) and the torch code around them; the map
of the CPU fast path is `fastgen.cpu`'s docstring. Nothing here imports the model or the engine,
so the attention backend can use these kernels."""
