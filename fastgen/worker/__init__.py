"""The pieces of one device's step below the model runner (`fastgen.model_runner`): the step's
inputs in persistent buffers (`step_inputs`, `block_table`, `buffers`, `packed_upload`), the KV cache
(`kv_cache`), the memory checks and profile (`memory`, `memory_profile`) and the sampler
(`sampler`, `penalties`, `top_logprobs`)."""
