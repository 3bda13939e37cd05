"""One device's side of a step: the model runner (`model_runner`), the step's inputs in
persistent buffers (`step_inputs`, `block_table`, `buffers`), the KV cache (`kv_cache`) and the
sampler (`sampler`)."""
