"""The incremental detokenizer's two ways to a stream's text: the tokenizer's own Rust
`DecodeStream` (Rust tokenizers, a prompt ending on a whole character) and the two decodes a step
in Python (everything else). Both must give the same pieces at the same tokens, so that a stream
and its stop strings do not depend on which one ran."""

from __future__ import annotations

import random

import pytest

from fastgen.engine.detokenizer import MOST_TOKENS_STREAMED, IncrementalDetokenizer
from tests.tiny_models import BYTE_TOKENS, CORPUS, build_tokenizer, sentencepiece_like_tokenizer

TOKENIZERS = {"byte-level": build_tokenizer, "sentencepiece-like": sentencepiece_like_tokenizer}


def pieces_of(tok, prompt, adds, streamed: bool) -> tuple[list[str], bool]:
    """The pieces `add` returns for each list of tokens, then `flush`; and whether the Rust stream
    was still running them before the flush."""
    detok = IncrementalDetokenizer(tok, prompt, streamed=streamed)
    pieces = [detok.add(ids) for ids in adds]
    streaming = detok.streaming
    assert streamed or not streaming
    return pieces + [detok.flush()], streaming


def random_ids(tok, bytes_too: bool) -> list[int]:
    """The ids a random tail draws from: the vocabulary and a few it lacks, byte-fallback tokens
    only where `bytes_too`."""
    vocab = tok.get_vocab()
    byte_ids = {vocab[byte] for byte in BYTE_TOKENS if byte in vocab}
    return [i for i in range(tok.vocab_size + 5) if bytes_too or i not in byte_ids]


def random_case(tok, rng: random.Random, most_at_once: int, tail: list[int]) -> tuple[list[int], list[list[int]]]:
    """A prompt cut from the corpus at a random token, and what follows it in the corpus plus a
    few ids drawn from `tail`, in lists of 1..most_at_once tokens."""
    ids = tok.encode(rng.choice(CORPUS[:6]) + " " + rng.choice(CORPUS[:6]), add_special_tokens=False)
    cut = rng.randrange(len(ids))
    rest = ids[cut:] + [rng.choice(tail) for _ in range(rng.randrange(8))]
    adds = []
    while rest:
        n = rng.randint(1, most_at_once)
        adds.append(rest[:n])
        rest = rest[n:]
    return ids[:cut], adds


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_the_rust_stream_gives_the_python_steps_pieces_token_for_token(kind):
    tok = TOKENIZERS[kind]()
    rng, tail = random.Random(0), random_ids(tok, bytes_too=True)
    streamed = 0
    for _ in range(150):
        prompt, adds = random_case(tok, rng, most_at_once=1, tail=tail)
        rust, used = pieces_of(tok, prompt, adds, streamed=True)
        python, _ = pieces_of(tok, prompt, adds, streamed=False)
        assert rust == python, (prompt, adds)
        streamed += used
    assert streamed > 100  # all but prompts that end inside a character, or a stream refused


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_several_tokens_at_once_give_the_same_text(kind):
    """Several tokens in one step (accepted drafts; a whole output decoded at its end) may come
    out a token sooner through the stream, never differently; past MOST_TOKENS_STREAMED the
    Python steps take over for good. Stray byte-fallback bytes included: a whole output with one
    is stepped through, so its text is the stream's (see the next test)."""
    tok = TOKENIZERS[kind]()
    rng, tail = random.Random(1), random_ids(tok, bytes_too=True)
    for _ in range(150):
        prompt, adds = random_case(tok, rng, most_at_once=2 * MOST_TOKENS_STREAMED, tail=tail)
        rust, _ = pieces_of(tok, prompt, adds, streamed=True)
        python, _ = pieces_of(tok, prompt, adds, streamed=False)
        assert "".join(rust) == "".join(python), (prompt, adds)


def test_a_stray_byte_that_the_stream_refuses_hands_over_to_the_python_steps():
    """Byte fallback: the bytes of "ø" decode to it, a stray continuation byte after them turns
    the run back into U+FFFD, so the window's text no longer begins with what the stream gave;
    the stream refuses it (tokenizers raises), and the two decodes run that token and the rest:
    one U+FFFD for the one stray byte. Several tokens at once give the text that one at a time
    gives ("ø" already out), where the two decodes over all three bytes at once would give three
    U+FFFD, and the whole output decoded at its end (the Python steps, not streamed) too."""
    tok = sentencepiece_like_tokenizer()
    vocab = tok.get_vocab()
    assert tok.encode("ø", add_special_tokens=False)[-2:] == [vocab["<0xC3>"], vocab["<0xB8>"]]
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    outputs = [vocab["<0xC3>"], vocab["<0xB8>"], vocab["<0xB8>"], *tok.encode(" jumps", add_special_tokens=False)]
    one_at_a_time, _ = pieces_of(tok, prompt, [[t] for t in outputs], streamed=False)
    for at_once in (1, 2, 3):
        adds = [outputs[i : i + at_once] for i in range(0, len(outputs), at_once)]
        rust, used = pieces_of(tok, prompt, adds, streamed=True)
        assert not used
        assert rust == one_at_a_time if at_once == 1 else "".join(rust) == "".join(one_at_a_time)
    assert "".join(rust) == "ø\ufffd jumps"
    whole, _ = pieces_of(tok, prompt, [outputs], streamed=False)
    assert "".join(whole) == "ø\ufffd jumps"
    assert tok.decode(outputs) == "\ufffd\ufffd\ufffd jumps"  # what decoding them at once gives


def test_a_prompt_that_ends_inside_a_character_takes_the_python_steps():
    """The stream would hold the prompt's incomplete bytes and give them out with the first
    output; the Python steps count the prompt as read."""
    tok = build_tokenizer()
    ids = tok.encode("東京", add_special_tokens=False)
    prompt = next(ids[:i] for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    adds = [[t] for t in ids[len(prompt):]]
    rust, used = pieces_of(tok, prompt, adds, streamed=True)
    python, _ = pieces_of(tok, prompt, adds, streamed=False)
    assert not used and rust == python
