"""The incremental detokenizer's two ways to a stream's text: the tokenizer's own Rust
`DecodeStream` (Rust tokenizers, a prompt ending on a whole character) and the two decodes a step
in Python (everything else). Both must give the same pieces at the same tokens, so that a stream
and its stop strings do not depend on which one ran."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fastgen.engine import detokenizer
from fastgen.engine.detokenizer import IncrementalDetokenizer
from tests.tiny_models import _CORPUS, build_tokenizer


def sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2's kind: words marked by a leading "▁" that decodes to a space (dropped at the start
    of a text), and bytes of characters outside the vocabulary as tokens of their own."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                                         show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte-level": build_tokenizer, "sentencepiece-like": sentencepiece_like_tokenizer}


def stream_pieces(tok, prompt, adds, rust: bool, monkeypatch) -> tuple[list[str], bool]:
    """The pieces `add` returns for each list of tokens, then `flush`; and whether the Rust stream
    ran them."""
    with monkeypatch.context() as patch:
        if not rust:
            patch.setattr(detokenizer, "DecodeStream", None)
        detok = IncrementalDetokenizer(tok, prompt)
        pieces = [detok.add(ids) for ids in adds]
        streamed = detok._stream is not None
        pieces.append(detok.flush())
    assert rust or not streamed
    return pieces, streamed


def random_case(tok, rng: random.Random, most_at_once: int) -> tuple[list[int], list[list[int]]]:
    """A prompt cut from the corpus at a random token, and what follows it in the corpus plus a
    few random ids (unknown ones too), in lists of 1..most_at_once tokens."""
    ids = tok.encode(rng.choice(_CORPUS[:6]) + " " + rng.choice(_CORPUS[:6]), add_special_tokens=False)
    cut = rng.randrange(len(ids))
    rest = ids[cut:] + [rng.randrange(tok.vocab_size + 5) for _ in range(rng.randrange(8))]
    adds = []
    while rest:
        n = rng.randint(1, most_at_once)
        adds.append(rest[:n])
        rest = rest[n:]
    return ids[:cut], adds


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_the_rust_stream_gives_the_python_steps_pieces_token_for_token(kind, monkeypatch):
    tok = TOKENIZERS[kind]()
    rng = random.Random(0)
    streamed = 0
    for _ in range(150):
        prompt, adds = random_case(tok, rng, most_at_once=1)
        rust, used = stream_pieces(tok, prompt, adds, True, monkeypatch)
        python, _ = stream_pieces(tok, prompt, adds, False, monkeypatch)
        assert rust == python, (prompt, adds)
        streamed += used
    assert streamed > 100  # all but prompts that end inside a character (byte-level)


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_several_tokens_at_once_give_the_same_text(kind, monkeypatch):
    """Several tokens in one step (accepted drafts; a whole output decoded at its end) may come
    out a token sooner through the stream, never differently; past `_MOST_TOKENS_STREAMED` the
    Python steps take over for good."""
    tok = TOKENIZERS[kind]()
    rng = random.Random(1)
    for _ in range(150):
        prompt, adds = random_case(tok, rng, most_at_once=2 * detokenizer._MOST_TOKENS_STREAMED)
        rust, _ = stream_pieces(tok, prompt, adds, True, monkeypatch)
        python, _ = stream_pieces(tok, prompt, adds, False, monkeypatch)
        assert "".join(rust) == "".join(python), (prompt, adds)


def test_a_prompt_that_ends_inside_a_character_takes_the_python_steps(monkeypatch):
    """The stream would hold the prompt's incomplete bytes and give them out with the first
    output; the Python steps count the prompt as read."""
    tok = build_tokenizer()
    ids = tok.encode("東京", add_special_tokens=False)
    prompt = next(ids[:i] for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    rust, used = stream_pieces(tok, prompt, [[t] for t in ids[len(prompt):]], True, monkeypatch)
    python, _ = stream_pieces(tok, prompt, [[t] for t in ids[len(prompt):]], False, monkeypatch)
    assert not used and rust == python
