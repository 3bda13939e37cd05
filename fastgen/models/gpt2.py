"""GPT-2, served through the same paged engine as the Llama family.

It differs from the Llama decoder in every layer: learned absolute position embeddings (`wpe`,
indexed by the step's positions, so chunked prefill, prefix caching and decode graphs need
nothing of their own), LayerNorm with bias, a GELU-tanh MLP, biases on every projection, plain
multi-head attention and an LM head tied to the token embeddings. Module names follow the
checkpoint's (`h.N.attn.c_attn`, `h.N.mlp.c_fc`, ...); its fused q|k|v `c_attn` is already one
matmul. Checkpoints store those projections as Conv1D ([in, out]); the loader transposes them
into nn.Linear. Tensor parallelism splits it as the Llama family does: c_attn (q|k|v) and c_fc
column-parallel, both c_proj row-parallel, wte and the tied LM head along the vocabulary; wpe
is replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastgen.attention import AttentionBackend, AttentionMetadata
from fastgen.compile import OpSet
from fastgen.layers.attention import PagedAttention
from fastgen.layers.norm import LayerNorm
from fastgen.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from fastgen.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from fastgen.models.gpt2_config import GPT2ModelConfig
from fastgen.models.loader import CheckpointFormat
from fastgen.parallel.group import SINGLE_RANK, TensorParallelGroup
from fastgen.parallel.sharding import even_shard

LayerCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache) of one layer


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2ModelConfig, layer_idx: int, backend: AttentionBackend, tp: TensorParallelGroup):
        super().__init__()
        heads = even_shard(cfg.hidden_size, tp.rank, tp.size)
        self.num_heads, self.head_dim = heads.size // cfg.head_dim, cfg.head_dim
        self.c_attn = ColumnParallelLinear(cfg.hidden_size, [heads] * 3, bias=True)  # q | k | v
        self.c_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, tp=tp)
        self.attn = PagedAttention(self.num_heads, self.num_heads, cfg.head_dim, backend,
                                   scale=cfg.attention_scale(layer_idx))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv: LayerCache) -> torch.Tensor:
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.c_attn(x).chunk(3, dim=-1))
        return self.c_proj(self.attn(q, k, v, meta, *kv).flatten(1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2ModelConfig, ops: OpSet, tp: TensorParallelGroup):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, [even_shard(cfg.intermediate_size, tp.rank, tp.size)], bias=True)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, tp=tp)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.ops.gelu_tanh(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2ModelConfig, layer_idx: int, backend: AttentionBackend, ops: OpSet,
                 tp: TensorParallelGroup):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ops)
        self.attn = GPT2Attention(cfg, layer_idx, backend, tp)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ops)
        self.mlp = GPT2MLP(cfg, ops, tp)

    def forward(self, positions, x, residual, meta: AttentionMetadata, kv: LayerCache):
        """x: the previous block's MLP output (or the token embeddings); residual: the stream it
        is added to. Returns this block's (MLP output, residual), for the next norm to add.
        positions: unused (GPT-2's positions enter as embeddings), taken as every family's
        layers take it."""
        x, residual = self.ln_1(x, residual)
        x = self.attn(x, meta, kv)
        x, residual = self.ln_2(x, residual)
        return self.mlp(x), residual


class GPT2LMHeadModel(nn.Module):
    """forward(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, hidden];
    compute_logits(hidden [S, hidden]) -> logits [S, vocab] in the model's dtype.

    kv_caches: one (k_cache, v_cache) pair per layer, in layer order (see `fastgen.worker.kv_cache`),
    each holding this rank's heads (tp: this process's tensor-parallel rank).
    positions must be below n_positions (EngineConfig bounds max_model_len by it).
    """

    checkpoint_format = CheckpointFormat(prefix="transformer.", transposed=frozenset({"c_attn", "c_proj", "c_fc"}),
                                         ignored=("h.*.attn.bias", "h.*.attn.masked_bias"))

    def __init__(self, cfg: GPT2ModelConfig, backend: AttentionBackend, ops: OpSet, max_positions: int,
                 tp: TensorParallelGroup = SINGLE_RANK):
        # max_positions (the engine's max_model_len) is not needed: wpe keeps all n_positions
        # rows the checkpoint holds.
        super().__init__()
        self.config = cfg
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i, backend, ops, tp) for i in range(cfg.num_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ops)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: Sequence[LayerCache]) -> torch.Tensor:
        # The position embeddings enter as the first residual, so the first block's fused
        # add+LayerNorm forms wte + wpe, the very sum transformers forms before its ln_1.
        x, residual = self.embed(input_ids, positions)
        for block, kv in zip(self.h, kv_caches, strict=True):
            x, residual = block(positions, x, residual, meta, kv)
        return self.final_hidden(x, residual)

    # The forward in three parts, for steps compiled a group of layers at a time
    # (`fastgen.cpu.layer_groups`).
    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.h

    def uniform_layers(self) -> bool:
        """Whether every block runs the same code on its own weights: not where each layer's
        scores are scaled by its own index."""
        return not self.config.scale_attn_by_inverse_layer_idx

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.wte(input_ids), self.wpe(positions)

    def final_hidden(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
