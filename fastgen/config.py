"""Engine configuration: one validated dataclass, the single source of every engine knob."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from fastgen.model_config import ModelConfig
from fastgen.sampling_params import SEED_LIMIT

DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# A CPU machine has no allocator to ask how much is free, so the KV cache gets a fixed budget
# unless the user gives one: enough for a few thousand tokens of a small model.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    model: path of a Hugging Face model folder.
    max_num_seqs: most sequences in one step (the decode batch).
    max_num_batched_tokens: most prompt tokens computed in one prefill step; longer prompts are
        split into chunks of at most this many tokens.
    max_model_len: longest sequence (prompt + output); default: the model's
        max_position_embeddings.
    block_size: tokens per KV-cache block (any positive value).
    dtype: "auto" (the model's own on CUDA; float32 on CPU, where most processors have no fast
        half-precision matmul), "float32", "bfloat16" or "float16".
    device: "auto" (CUDA when present), "cpu", "cuda" or "cuda:N".
    gpu_memory_utilization: share of the GPU's memory the engine may use in total (CUDA).
    kv_cache_memory_bytes: explicit KV-cache budget in bytes (default on CPU: 1 GiB).
    num_kv_blocks: explicit number of KV blocks; wins over both budgets above.
    enable_prefix_caching: share full blocks between requests with a common prefix.
    enforce_eager: never use CUDA graphs.
    cuda_graph_batch_sizes: padded decode batch sizes to capture (default: 1, 2, 4, 8, then
        steps of 8 up to 64 and of 16 beyond, up to min(max_num_seqs, max_cuda_graph_batch_size)).
    max_cuda_graph_batch_size: cap on the largest captured batch.
    use_torch_compile: compile RMSNorm, RoPE, SiLU-and-mul and the sampler; None means "on CUDA".
    seed: seed of the sampler's generator for requests that bring no seed of their own.
    """

    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 256
    dtype: str = "auto"
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_batch_sizes: list[int] | None = None
    max_cuda_graph_batch_size: int = 512
    use_torch_compile: bool | None = None
    seed: int = 0
    model_config: ModelConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.model = str(self.model)
        self.model_config = ModelConfig.from_folder(self.model)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_cuda_graph_batch_size", self.max_cuda_graph_batch_size, 1)
        _check_int("seed", self.seed, 0)
        if self.seed >= SEED_LIMIT:
            raise ValueError(f"seed={self.seed} must be < 2**64")
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        _check_int("max_model_len", self.max_model_len, 2)
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {['auto', *DTYPE_NAMES]}")
        if isinstance(self.device, torch.device):
            self.device = str(self.device)
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"device={self.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.torch_device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r} but CUDA is not available on this machine")
            count = torch.cuda.device_count()
            if self.torch_device.index is not None and self.torch_device.index >= count:
                raise ValueError(f"device={self.device!r} but this machine has {count} CUDA device(s)")
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]"
            )
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.cuda_graph_batch_sizes is not None:
            if isinstance(self.cuda_graph_batch_sizes, (int, str)) or not self.cuda_graph_batch_sizes:
                raise ValueError(f"cuda_graph_batch_sizes={self.cuda_graph_batch_sizes!r} must list at least one size")
            for size in self.cuda_graph_batch_sizes:
                _check_int("cuda_graph_batch_sizes", size, 1)
            self.cuda_graph_batch_sizes = sorted(set(self.cuda_graph_batch_sizes))

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return self.model_config.torch_dtype if self.torch_device.type == "cuda" else torch.float32
        return DTYPE_NAMES[self.dtype]

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of every block table: enough blocks for a max_model_len sequence."""
        return -(-self.max_model_len // self.block_size)

    @property
    def compile_enabled(self) -> bool:
        if self.use_torch_compile is None:
            return self.torch_device.type == "cuda"
        return self.use_torch_compile

    @property
    def graphs_enabled(self) -> bool:
        return self.torch_device.type == "cuda" and not self.enforce_eager


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
