"""Weight-only quantization: how quantized weights are laid out, made and multiplied.

- `formats`: `QuantFormat` (bits, group size, whether groups carry a minimum) and the methods an
  engine accepts (`int8`, `int4`);
- `quantize`: float weights into codes and scales, and back (`dequantize`, the reference every
  kernel is tested against);
- `ops`: the `fastgen::quantized_linear` op the layers call, its eager kernel, and the quantized
  embedding lookup;
- `gguf_blocks`: llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks read into the same layout, without a
  detour through bf16.

Below `layers`: it knows tensors, not modules.
"""
