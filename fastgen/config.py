"""Engine configuration: one validated dataclass, the single source of every engine knob.

Each field's docstring (the string under it) is its documentation here, in `--help` (the CLI's
engine flags are generated from these fields) and in the README's list; each field's check runs
both at construction and on the flag's value.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cache
from typing import TYPE_CHECKING

from fastgen.checks import boolean, integer, positive_real, real
from fastgen.cpu.native.features import has_native_bf16
from fastgen.models.config import DTYPE_NAMES, ModelConfig, torch_dtype
from fastgen.models.hub import resolve_model_path
from fastgen.quantization.formats import METHODS as QUANTIZATION_METHODS
from fastgen.quantization.formats import check_group_size_fits
from fastgen.sampling_params import SEED_LIMIT
from fastgen.speculative.config import check_speculative_config

if TYPE_CHECKING:
    import torch

# A CPU machine has no allocator to ask how much is free, so the KV cache gets a fixed budget
# unless the user gives one: enough for a few thousand tokens of a small model.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
LOAD_FORMATS = ("safetensors", "dummy")  # real weights from the folder, or random ones
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
COMPILE_MODES = ("background", "blocking", "off")

# (field name, value) -> the value as the engine keeps it (plain Python types), or ValueError
# naming the field, the value and the limit.
Check = Callable[[str, object], object]


def at_least(minimum: int, below: int | None = None, below_text: str | None = None) -> Check:
    def check(name: str, value: object) -> int:
        return integer(name, value, minimum, below, below_text)

    return check


def fraction(name: str, value: object) -> float:
    return real(name, value, "in (0, 1]", low=0.0, high=1.0, low_open=True)


def one_of(choices: tuple[str, ...]) -> Check:
    def check(name: str, value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name}={value!r} is not one of {list(choices)}")
        return value

    return check


def device_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not DEVICE_PATTERN.fullmatch(value):
        raise ValueError(f"{name}={value!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return value


def optional(check: Check) -> Check:
    def check_unless_none(name: str, value: object) -> object:
        return None if value is None else check(name, value)

    return check_unless_none


def batch_sizes(name: str, value: object) -> list[int]:
    if isinstance(value, (int, str)) or not hasattr(value, "__iter__") or not list(value):
        raise ValueError(f"{name}={value!r} must list at least one size")
    return [integer(name, size, minimum=1) for size in value]


def _knob(default, check: Check):
    return field(default=default, metadata={"check": check})


def resolve_device(device: str) -> str:
    """'auto' / 'cuda' / 'cuda:N' / 'cpu' -> 'cpu' or 'cuda:N' (ValueError when CUDA is absent or N
    is out of range).

    CUDA calls that take a device (`torch.cuda.set_device`, graph capture, memory queries) need
    its index: torch 2.11 refuses `set_device(torch.device("cuda"))`, so the index is fixed here,
    once, from the thread's current device.
    """
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        if device == "auto":
            return "cpu"
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    index = torch.cuda.current_device() if device in ("auto", "cuda") else int(device.split(":")[1])
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device={device!r} but this machine has {count} CUDA device(s)")
    return f"cuda:{index}"


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance (see each field's docstring)."""

    model: str
    """A Hugging Face model folder, or a model id found in the local Hugging Face cache."""
    max_num_seqs: int = _knob(256, at_least(1))
    """Most sequences in one step (the decode batch)."""
    max_num_batched_tokens: int = _knob(8192, at_least(1))
    """The token budget of one step: every running sequence's decode token first, then prompt
    chunks in what remains; longer prompts are split over several steps. Keep it above
    max_num_seqs: a budget that the decodes use up leaves prompts waiting until streams end."""
    long_prefill_token_threshold: int | None = _knob(None, optional(at_least(0)))
    """Most prompt tokens in a step that also decodes running sequences, all prompts together,
    the prompts with the fewest tokens left first (one that eight such steps in a row passed over
    goes first): a long prompt arriving beside the streams costs each of them several short
    steps, not one long freeze, and however many prompts are under way a step carries one cap of
    prompt work (vLLM caps each prompt with an option of this name and limits the prompts in
    progress with max_num_partial_prefills). 0: no cap beyond the budget. Default: 64 on CPU (a
    prompt token at a 3,000-token context costs about 3 ms there, so a chunk stays within about
    ten decode steps); none on CUDA, whose mixed steps run eagerly (tens of ms of host work
    each), so more of them would cost a long prompt more than they save the streams."""
    overlap_scheduling: bool | None = _knob(None, optional(boolean))
    """Schedule and launch each step before reading the previous one's tokens: the device computes
    step N+1 while the host reads step N's tokens and makes its outputs (stop checks, text), and
    the tokens sampled in N reach N+1's inputs on the device. A request that N ends (a stop
    token or string) has one token too many computed, which is dropped. Steps with speculative
    drafts or grammar masks need the previous tokens on the host and run in turn, as does a
    tensor-parallel engine. Default: on CUDA, off on CPU (where the model runs in the host's
    own threads, so there is nothing to overlap and each output would come a step later)."""
    max_model_len: int | None = _knob(None, optional(at_least(2)))
    """Longest sequence, prompt + output. Default: the model's length limit (config.json's
    max_position_embeddings; n_positions for GPT-2)."""
    block_size: int = _knob(256, at_least(1))
    """Tokens per KV-cache block (any positive value)."""
    dtype: str = _knob("auto", one_of(DTYPE_CHOICES))
    """Weight and activation dtype. auto: the model's own on CUDA; on CPU bfloat16 for a bfloat16
    model when the processor has native bf16 (AVX-512 BF16 or AMX, several times float32's
    matmul rate), else float32."""
    quantization: str | None = _knob(None, optional(one_of((*QUANTIZATION_METHODS, "gguf"))))
    """Weight-only quantization, done once at load: int8 (one scale per output channel) or int4
    (a scale and a minimum per group of quantization_group_size inputs, as llama.cpp's Q4_1); the
    LM head and embedding take int8 under both. gguf: the Q8_0 / Q4_0 / Q4_1 blocks of the GGUF
    file the model was converted from, as they are (model: a .gguf file, or the default model,
    whose file is Q4_1). Activations and the KV cache stay in dtype, but for the CPU's products
    of a few bf16 rows, which round each row to int8 in blocks of 32 inputs (as llama.cpp does;
    README, "Quantized weights"). Kernels: C++ on the CPU, Triton on CUDA. Default: gguf for a
    .gguf model whose blocks are all of those types (on one rank), else the weights as the
    checkpoint has them."""
    quantization_group_size: int | None = _knob(None, optional(at_least(2)))
    """Inputs that share one scale under quantization. Default: 32 for int4, a whole row for
    int8. Must divide every linear layer's input width (and be even for int4)."""
    device: str = _knob("auto", device_name)
    """auto (CUDA when present), cpu, cuda or cuda:N. Resolved once, at construction, to cpu or
    cuda:N ("cuda" and "auto" take the current CUDA device), so every later use names its index."""
    gpu_memory_utilization: float = _knob(0.9, fraction)
    """Share of the GPU's memory the engine may use in total (CUDA)."""
    kv_cache_memory_bytes: int | None = _knob(None, optional(at_least(1)))
    """Explicit KV-cache budget in bytes, per device (each tensor-parallel rank holds its own share
    of the heads). Default: what gpu_memory_utilization leaves on CUDA, 1 GiB on CPU."""
    num_kv_blocks: int | None = _knob(None, optional(at_least(1)))
    """Explicit number of KV-cache blocks; wins over both budgets."""
    attention_backend: str = _knob("auto", one_of(ATTENTION_BACKENDS))
    """auto: torch on CPU; on CUDA flash-attn when installed, else triton (fastgen's kernels).
    triton on a CPU runs only under TRITON_INTERPRET=1 (tests)."""
    enable_prefix_caching: bool = _knob(True, boolean)
    """Share full KV blocks between requests with a common prefix."""
    enforce_eager: bool | None = _knob(None, optional(boolean))
    """Run decode eagerly: no CUDA graphs (CUDA), no compiled decode step (CPU). Default: false,
    unless $FASTGEN_ENFORCE_EAGER=1 (the test suite's setting: its many short-lived engines
    would each pay a compile)."""
    compile_mode: str = _knob("background", one_of(COMPILE_MODES))
    """How the CPU's compiled steps are built, where they are not yet in the cache. background: the
    engine serves at once, eagerly and with a thread fewer, while a child process compiles them, and
    loads them at the first step after the child has ended; blocking: the first step that needs a graph waits
    until it and the engine's other graphs are built (`compile_processes`; what benchmarks want:
    no eager steps in the measurement); off: none are built (eager steps). A graph already in the
    cache is loaded in seconds either way. CUDA graphs are always captured at start-up."""
    compile_processes: int | None = _knob(None, optional(at_least(1)))
    """Blocking mode: how many processes compile the missing CPU graphs at once. The first step
    that needs a graph compiles it in this process while helper processes compile the others,
    and then waits for them. 1: this process alone, each graph when a step first needs it.
    Default: one process per CPU core (never more than one per missing graph). Where the layers
    compile in groups an engine has two CPU step graphs (`fastgen.cpu.compiled_decode`: a group of
    layers and the LM head), so one helper compiles the head's while this process compiles the
    group's."""
    cuda_graph_batch_sizes: list[int] | None = _knob(None, optional(batch_sizes))
    """Padded decode batch sizes to capture. Default: 1, 2, 4, 8, then steps of 8 up to 64 and of
    16 beyond, up to min(max_num_seqs, max_cuda_graph_batch_size)."""
    max_cuda_graph_batch_size: int = _knob(512, at_least(1))
    """Largest decode batch captured in a CUDA graph by default."""
    use_torch_compile: bool | None = _knob(None, optional(boolean))
    """torch.compile the element-wise ops and the sampler. Default: on CUDA only."""
    seed: int = _knob(0, at_least(0, below=SEED_LIMIT, below_text="2**64"))
    """Seed of the sampler's generator for requests that bring no seed of their own."""
    max_logprobs: int = _knob(20, at_least(0))
    """Most logprobs (and prompt_logprobs) a request may ask for per token, as in vLLM."""
    tensor_parallel_size: int = _knob(1, at_least(1))
    """Processes (one device each) that one model is split across: attention heads, MLP columns and
    the vocabulary are divided between them, and each holds its share of the KV cache. Ranks
    1..N-1 are spawned on this machine, or joined from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK). On CUDA, rank r uses the device's index + r (its
    LOCAL_RANK under torchrun); on CPU any size runs (gloo)."""
    distributed_timeout_s: float = _knob(300.0, positive_real)
    """Seconds tensor-parallel start-up may wait for a rank (to start, join, load its shard)
    before the engine fails; a rank that dies or raises fails the engine at once."""
    distributed_step_timeout_s: float = _knob(30.0, positive_real)
    """Seconds a collective inside a step may wait for another rank (a network partition, a rank
    stuck or slowed) before the engine fails with TensorParallelError (gloo, on CPU; on CUDA
    NCCL's collectives keep distributed_timeout_s); how long rank 0's step broadcasts wait for
    a worker to take them (every device); also how long a worker goes on without reaching rank
    0 before it exits."""
    speculative_config: dict | None = _knob(None, optional(check_speculative_config))
    """Speculative decoding (vLLM's names): {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m} proposes up to k tokens a step for each
    decoding sequence by prompt lookup (what followed an earlier occurrence of its last n..m
    tokens, in the request's predicted output, else in its prompt and output: near where its last
    draft would have gone on there, else the latest), and verifies them with the rest of the batch in
    one forward: greedy output stays the same token for token, and sampled output keeps its
    distribution. Defaults k=4, n=4, m=1 (drafts after a one-token match weighed by their own
    acceptance). {"method": "draft_model",
    "model": path, "quantization": None | "int8" | "int4"} proposes a smaller model's greedy
    continuation instead (same tokenizer; its own paged KV cache of as many blocks as the
    engine's; the engine's own model quantized to int4 drafts well for itself). A sequence's draft is as long
    as its recent acceptance pays for at the step's batch size (none once it would not pay;
    "disable_by_batch_size": B also stops all drafts in steps of B sequences or more). Requests
    with penalties, a grammar, logprobs or unmet min_tokens decode one token a step. None: off."""
    max_waiting_requests: int = _knob(1024, at_least(1))
    """Most requests add_request lets wait for a first schedule; one more is refused at once
    (EngineOverloaded; HTTP 503 in the server) instead of queueing without bound. Batch
    LLM.generate calls are not capped."""
    model_config: ModelConfig = field(init=False, repr=False)
    gguf_file: str | None = field(init=False, repr=False, default=None)
    """With quantization="gguf": the GGUF file whose blocks the engine loads."""

    def __post_init__(self) -> None:
        from_gguf = str(self.model).endswith(".gguf")
        self.model = resolve_model_path(str(self.model))
        self.model_config = ModelConfig.from_folder(self.model)
        if type(self.device).__module__ == "torch":  # a torch.device
            self.device = str(self.device)
        for f in fields(self):
            if "check" in f.metadata:
                setattr(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's {self.model_config.max_len_limit}"
            )
        self.device = resolve_device(self.device)
        if self.quantization_group_size is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization_group_size={self.quantization_group_size} needs a quantization method "
                             f"(one of {list(QUANTIZATION_METHODS)}), got quantization={self.quantization!r}")
        mc, tp = self.model_config, self.tensor_parallel_size
        if tp == 1 or (mc.num_heads % tp == 0 and mc.intermediate_size % tp == 0):  # (else launch names the split)
            per_rank = "" if tp == 1 else f" (its share on each of {tp} ranks)"
            check_group_size_fits(self.quantization, self.quantization_group_size, {
                "the layers fed the hidden state": mc.hidden_size,
                f"the attention output projection{per_rank}": mc.num_heads * mc.head_dim // tp,
                f"the MLP's down projection{per_rank}": mc.intermediate_size // tp,
            })
        if from_gguf and self.quantization is None and self.tensor_parallel_size == 1:
            from fastgen.models.gguf_weights import gguf_source, reads_every_matrix

            # A GGUF file is served from its own blocks where fastgen reads all of them (else,
            # and under tensor parallelism, from the converted folder's weights).
            if reads_every_matrix(gguf_source(self.model)):
                self.quantization = "gguf"
        if self.quantization == "gguf":
            self._find_gguf_file()
        if self.enforce_eager is None:
            self.enforce_eager = os.environ.get("FASTGEN_ENFORCE_EAGER") == "1"
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = 64 if self.device == "cpu" else 0
        if self.overlap_scheduling is None:
            self.overlap_scheduling = self.device != "cpu"
        self._check_attention_backend()
        if self.tensor_parallel_size > 1:
            from fastgen.distributed.launch import check_world

            check_world(self)
        if self.cuda_graph_batch_sizes is not None:
            self.cuda_graph_batch_sizes = sorted(set(self.cuda_graph_batch_sizes))
        if self.speculative_config is not None and self.speculative_config["method"] == "draft_model":
            self._check_draft_model()

    def _check_draft_model(self) -> None:
        """The draft model's folder resolved, and refused where it cannot draft for this engine:
        token ids past the target's vocabulary (the target could not embed them), a context
        shorter than max_model_len, or tensor parallelism."""
        name = "speculative_config['model']"
        spec = self.speculative_config
        try:
            spec["model"] = resolve_model_path(spec["model"])
            draft = ModelConfig.from_folder(spec["model"])
        except ValueError as exc:
            raise ValueError(f"{name}={spec['model']!r}: {exc}") from exc
        if draft.vocab_size > self.model_config.vocab_size:
            raise ValueError(f"{name}={spec['model']!r} has a vocabulary of {draft.vocab_size} tokens, more than the "
                             f"model's {self.model_config.vocab_size}: a draft model must share the model's tokenizer")
        if draft.max_position_embeddings < self.max_model_len:
            raise ValueError(f"{name}={spec['model']!r} holds {draft.max_position_embeddings} positions, fewer than "
                             f"max_model_len={self.max_model_len}")
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative_config['method']='draft_model' runs on one rank, got "
                             f"tensor_parallel_size={self.tensor_parallel_size}")

    def _find_gguf_file(self) -> None:
        from fastgen.models.gguf_weights import gguf_source

        source = gguf_source(self.model)
        if source is None or not source.is_file():
            raise ValueError(f"quantization='gguf' needs a model converted from a GGUF file (pass the .gguf file as "
                             f"model); model={self.model!r} " + ("is not one" if source is None
                                                                 else f"came from {str(source)!r}, which is gone"))
        if self.tensor_parallel_size > 1:
            raise ValueError("quantization='gguf' runs on one rank, got "
                             f"tensor_parallel_size={self.tensor_parallel_size}")
        self.gguf_file = str(source)

    def _check_attention_backend(self) -> None:
        name, on_cuda = self.attention_backend, self.device.startswith("cuda")
        if name == "flash-attn" and not on_cuda:
            raise ValueError(f"attention_backend='flash-attn' needs a CUDA device, got device={self.device!r}")
        if name == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' on device={self.device!r} runs only under TRITON_INTERPRET=1")

    def init_values(self) -> dict:
        """Every field the constructor takes, by name, as resolved (defaults applied): enough to
        build the same configuration again."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @property
    def torch_device(self) -> torch.device:
        """The resolved device: `cpu` or `cuda:N`, always with its index on CUDA."""
        import torch

        return torch.device(self.device)

    @property
    def dtype_name(self) -> str:
        """The canonical name of the dtype the engine runs in ("auto" resolved)."""
        if self.dtype != "auto":
            return DTYPE_NAMES[self.dtype]
        if self.torch_device.type == "cuda":
            return self.model_config.dtype
        return "bfloat16" if self.model_config.dtype == "bfloat16" and has_native_bf16() else "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads one tensor-parallel rank holds in its cache (all of them with one rank)."""
        from fastgen.parallel.sharding import kv_heads_per_rank

        return kv_heads_per_rank(self.model_config.num_kv_heads, self.tensor_parallel_size)

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

    @property
    def compiled_decode_enabled(self) -> bool:
        """The CPU counterpart of decode graphs: the decode step compiled whole (one rank, the
        torch attention backend)."""
        return (self.torch_device.type == "cpu" and not self.enforce_eager and self.compile_mode != "off"
                and self.tensor_parallel_size == 1 and self.attention_backend in ("auto", "torch"))


@cache
def field_docs(cls: type = EngineConfig) -> dict[str, str]:
    """Each field's docstring (the string literal right under it), whitespace collapsed."""
    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs
