"""The decoder of the Llama family and its Qwen relatives.

Llama (SmolLM2, Llama 3), Qwen2 and Qwen3 share the architecture; they differ in two switches
read from `LlamaFamilyConfig` (set per architecture in `fastgen.models.registry`): Qwen2 adds a
bias to the q/k/v projections (Llama and Qwen3 to all four where config.json's attention_bias
says so), Qwen3 RMS-normalises q and k per head before RoPE. Tokens of all
sequences are laid end to end ([T, hidden]); where each sits in the paged cache arrives in
`AttentionMetadata`, and each layer's cache slice with it. Projections are merged (q|k|v,
gate|up) so a layer runs two matmuls where transformers runs five.

Tensor parallelism (`tp`, one rank of several): q|k|v and gate|up are column-parallel, o_proj
and down_proj row-parallel (one all-reduce each), so attention runs on this rank's heads and the
activation on its MLP columns; the embedding and LM head split the vocabulary
(`fastgen.layers.vocab_parallel`). With one rank every layer is the plain one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastgen.attention import AttentionBackend, AttentionMetadata
from fastgen.compile import OpSet
from fastgen.layers.attention import PagedAttention
from fastgen.layers.norm import RMSNorm
from fastgen.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from fastgen.layers.rotary import RotaryEmbedding, rope_table_positions
from fastgen.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from fastgen.models.llama_family_config import LlamaFamilyConfig
from fastgen.models.loader import CheckpointFormat
from fastgen.models.one_launch_layer import link_next_layers, one_launch_decode
from fastgen.parallel.group import SINGLE_RANK, TensorParallelGroup
from fastgen.parallel.sharding import even_shard, kv_head_shard

LayerCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache) of one layer


class SelfAttention(nn.Module):
    """Attention over this rank's query heads and the KV heads they read."""

    def __init__(self, cfg: LlamaFamilyConfig, rotary: RotaryEmbedding, backend: AttentionBackend, ops: OpSet,
                 tp: TensorParallelGroup):
        super().__init__()
        q_shard = even_shard(cfg.num_heads * cfg.head_dim, tp.rank, tp.size)
        kv_shard = kv_head_shard(cfg.num_kv_heads, cfg.head_dim, tp.rank, tp.size)
        self.head_dim = cfg.head_dim
        self.num_heads = q_shard.size // cfg.head_dim
        self.num_kv_heads = kv_shard.size // cfg.head_dim
        self.q_size, self.kv_size = q_shard.size, kv_shard.size
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_shard, kv_shard, kv_shard], bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q_shard.full, cfg.hidden_size, bias=cfg.o_proj_bias, tp=tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, backend)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata,
                kv: LayerCache) -> torch.Tensor:
        """qkv: this layer's q|k|v projection (`qkv_proj`, which the layer runs behind its norm)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        out = self.attn(q, k, v, meta, *kv, positions=positions, cos_sin=self.rotary.cos_sin, qk_norm=qk_norm)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """gate|up, SwiGLU, down; the layer runs gate|up and SwiGLU behind its norm
    (`RMSNorm.project`) and `down_proj` on their output."""

    def __init__(self, cfg: LlamaFamilyConfig, tp: TensorParallelGroup):
        super().__init__()
        columns = even_shard(cfg.intermediate_size, tp.rank, tp.size)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [columns, columns], bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False, tp=tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, rotary: RotaryEmbedding, backend: AttentionBackend, ops: OpSet,
                 tp: TensorParallelGroup):
        super().__init__()
        self.self_attn = SelfAttention(cfg, rotary, backend, ops, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions, x, residual, meta: AttentionMetadata, kv: LayerCache):
        one_launch = one_launch_decode(self, positions, x, residual, meta, kv)
        if one_launch is not None:
            return one_launch
        # Each norm feeds the product after it (one launch for both at decode batches on CUDA).
        qkv, residual = self.input_layernorm.project(x, residual, self.self_attn.qkv_proj)
        x = self.self_attn(positions, qkv, meta, kv)
        h, residual = self.post_attention_layernorm.project(x, residual, self.mlp.gate_up_proj, swiglu=True)
        return self.mlp.down_proj(h), residual


class LlamaFamilyForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, hidden];
    compute_logits(hidden [S, hidden]) -> logits [S, vocab] in the model's dtype.

    kv_caches: one (k_cache, v_cache) pair per layer, in layer order (see `fastgen.worker.kv_cache`),
    each holding this rank's KV heads. tp: this process's rank of the tensor-parallel group; every
    rank runs the same forward and gets the same logits.
    """

    checkpoint_format = CheckpointFormat(
        prefix="model.",
        merged={
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        },
        ignored=("layers.*.self_attn.rotary_emb.inv_freq",),
    )

    def __init__(self, cfg: LlamaFamilyConfig, backend: AttentionBackend, ops: OpSet, max_positions: int,
                 tp: TensorParallelGroup = SINGLE_RANK):
        super().__init__()
        self.config = cfg
        # The table covers max_positions (the engine's max_model_len), rounded up so that engines
        # of nearby lengths share compiled steps.
        positions = rope_table_positions(max_positions, cfg.max_position_embeddings)
        rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, backend, ops, tp) for _ in range(cfg.num_layers))
        link_next_layers(self.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: Sequence[LayerCache]) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, meta, kv)
        x, _ = self.norm(x, residual)
        return x

    # The forward in three parts, for steps compiled a group of layers at a time
    # (`fastgen.cpu.layer_groups`): every layer is called as layer(positions, x, residual, meta, kv).
    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def uniform_layers(self) -> bool:
        """Whether every layer runs the same code on its own weights (one compiled layer serves all)."""
        return True

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's (x, residual). The residual is zeros, so that the first layer, too,
        adds it before its norm (x + 0 is x exactly) and runs the same code as the others."""
        x = self.embed_tokens(input_ids)
        return x, torch.zeros_like(x)

    def final_hidden(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
