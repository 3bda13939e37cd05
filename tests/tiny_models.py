"""Tiny random-weight Qwen3, Qwen2, Llama and GPT-2 models built with transformers, plus a small
byte-level BPE tokenizer trained on the spot (and a SentencePiece-like one with byte fallback),
so tests need no model hub."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

EOS = "<|endoftext|>"
VOCAB_SIZE = 384

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching schedules prefill first, then decode.",
    "Prefix caching shares full blocks between requests.",
    "Grüße aus Köln! 東京は晴れ。 Emoji: 🚀✨ and accents: café, naïve, señor.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
] * 20

_SHAPES = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    # Wider than transformers' default init so the random model's next-token distribution is
    # peaked: greedy comparisons then test the engine, not float ties.
    initializer_range=0.2,
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def model_config(family: str):
    eos_id = 0  # the first special token
    if family == "qwen3":
        return Qwen3Config(**_SHAPES, head_dim=32, tie_word_embeddings=True, rope_theta=1e6, eos_token_id=eos_id)
    if family == "qwen2":
        return Qwen2Config(**_SHAPES, tie_word_embeddings=False, rope_theta=1e6, eos_token_id=eos_id)
    if family == "llama":
        return LlamaConfig(
            **_SHAPES,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            eos_token_id=eos_id,
        )
    if family == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB_SIZE, n_embd=_SHAPES["hidden_size"], n_inner=_SHAPES["intermediate_size"],
            n_layer=_SHAPES["num_hidden_layers"], n_head=_SHAPES["num_attention_heads"],
            n_positions=_SHAPES["max_position_embeddings"], initializer_range=_SHAPES["initializer_range"],
            bos_token_id=eos_id, eos_token_id=eos_id,
        )
    raise ValueError(family)


def build_tiny_model(family: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """overrides: config attributes set on top of the family's tiny config."""
    torch.manual_seed(seed)
    config = model_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype = torch.float32,
    **generate_kwargs,
) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt (one at a time: no padding), never
    stopping early at EOS unless `generate_kwargs` names an eos_token_id (other generate()
    arguments, such as repetition_penalty or min_new_tokens, go through too)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    kwargs = {"min_new_tokens": 0, **generate_kwargs}
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
            results.append(out[0, len(ids) :].tolist())
    return results


BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]


def sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2's kind: words marked by a leading "▁" that decodes to a space (dropped at the start
    of a text), and each byte of a character outside the vocabulary a token of its own, which
    decode together once they make a character (byte fallback)."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                                            show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab.update({byte: len(vocab) + i for i, byte in enumerate(BYTE_TOKENS)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
