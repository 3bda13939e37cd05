"""Tokenizers load through the `tokenizers` library (fast) with transformers' results, and fall
back to transformers for folders that need its model-specific classes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import pytest
from transformers import AutoTokenizer

from fastgen.engine.prompts import chat_token_ids
from fastgen.engine.tokenizer import FastTokenizer, load_tokenizer
from tests.engine.tokenizer_parity import assert_same_as_transformers
from tests.tiny_models import build_tokenizer, sentencepiece_like_tokenizer

SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_folder(tmp_path, **config_changes):
    folder = tmp_path / "tok"
    build_tokenizer().save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(config_changes)
    config_file.write_text(json.dumps(config))
    return folder


def test_the_test_models_tokenizer_matches_transformers(tiny_models):
    assert_same_as_transformers(tiny_models["qwen3"])


def test_a_chat_template_with_special_tokens_matches_transformers(tmp_path):
    assert_same_as_transformers(tokenizer_folder(tmp_path, chat_template=SMOLLM_TEMPLATE, bos_token="<|endoftext|>"))


@pytest.mark.parametrize("changes", [{"tokenizer_class": "GPT2Tokenizer"}, {"add_prefix_space": True},
                                     {"bos_token": "<never-seen-before>"}, {"add_bos_token": True},
                                     {"add_eos_token": False}, {"clean_up_tokenization_spaces": True}])
def test_folders_needing_transformers_fall_back_to_it(tmp_path, changes):
    tokenizer = load_tokenizer(str(tokenizer_folder(tmp_path, **changes)))
    assert not isinstance(tokenizer, FastTokenizer)
    assert tokenizer.encode("Hello") == AutoTokenizer.from_pretrained(tmp_path / "tok").encode("Hello")


@pytest.mark.parametrize("field", ["special", "lstrip"])
def test_a_config_that_describes_an_added_token_otherwise_falls_back(tmp_path, field):
    """tokenizer_config.json's added_tokens_decoder overrides tokenizer.json's flags in
    transformers (special: skip_special_tokens drops the token; lstrip: it eats the space before
    it); the fast path defers to it."""
    folder = tmp_path / "tok"
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<extra>"])  # neither special nor stripping in tokenizer.json
    tokenizer.save_pretrained(folder)
    extra = tokenizer.convert_tokens_to_ids("<extra>")
    assert isinstance(load_tokenizer(str(folder)), FastTokenizer)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    entry = {"content": "<extra>", "lstrip": False, "normalized": True, "rstrip": False, "single_word": False,
             "special": False}
    config["added_tokens_decoder"] = {str(extra): {**entry, field: True}}
    config_file.write_text(json.dumps(config))
    assert not isinstance(load_tokenizer(str(folder)), FastTokenizer)
    # What the fast path would have given, and transformers does not.
    from tokenizers import Tokenizer

    fast = FastTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")), config)
    theirs = AutoTokenizer.from_pretrained(folder)
    text, ids = "brown <extra> fox", [extra, extra]
    assert (fast.encode(text), fast.decode(ids, skip_special_tokens=True)) != \
        (theirs.encode(text), theirs.decode(ids, skip_special_tokens=True))


def test_a_folder_with_only_a_vocab_file_falls_back(tmp_path, tiny_models):
    folder = tmp_path / "no-tokenizer-json"
    shutil.copytree(tiny_models["qwen3"], folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="could not load its tokenizer"):
        load_tokenizer(str(folder))


def test_a_template_with_generation_blocks_matches_transformers(tmp_path):
    """transformers' `{% generation %}` marks (for assistant-token masks) render as their content."""
    template = SMOLLM_TEMPLATE.replace(
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}",
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endif %}")
    assert "{% generation %}" in template
    assert_same_as_transformers(tokenizer_folder(tmp_path, chat_template=template))


@pytest.mark.parametrize("fallback", [False, True], ids=["fast", "transformers"])
def test_content_given_as_text_parts_is_joined_and_template_errors_are_value_errors(tmp_path, fallback):
    """Both kinds of tokenizer: fastgen's own renderer and transformers' (a folder that needs it)."""
    changes = {"add_bos_token": True} if fallback else {}
    tokenizer = load_tokenizer(str(tokenizer_folder(tmp_path, chat_template=SMOLLM_TEMPLATE, **changes)))
    assert isinstance(tokenizer, FastTokenizer) is not fallback
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert chat_token_ids(tokenizer, [{"role": "user", "content": parts}]) == \
        chat_token_ids(tokenizer, [{"role": "user", "content": "Hello, world"}])
    with pytest.raises(ValueError, match=r"messages\[0\].content holds a 'image_url' part; fastgen serves text only"):
        chat_token_ids(tokenizer, [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    # Whatever the template raises on content it cannot use (here str + int: a TypeError).
    with pytest.raises(ValueError, match="chat template failed on these messages: TypeError"):
        chat_token_ids(tokenizer, [{"role": "user", "content": 5}])


def test_a_conversation_that_cannot_fit_is_refused_before_it_is_tokenized(tmp_path):
    tokenizer = load_tokenizer(str(tokenizer_folder(tmp_path, chat_template=SMOLLM_TEMPLATE)))
    encoded = []
    encode = tokenizer.encode
    tokenizer.encode = lambda text, **kwargs: encoded.append(len(text)) or encode(text, **kwargs)
    content = "brown fox " * 1_000  # past 8 x 256 characters, not past the longest-entry bound
    with pytest.raises(ValueError, match=r"messages has 10,\d\d\d characters: it cannot fit in max_model_len=256 "
                                         r"tokens \(its first 2,048 characters alone are"):
        chat_token_ids(tokenizer, [{"role": "user", "content": content}], max_tokens=256)
    assert encoded == [2048]  # the probe alone
    with pytest.raises(ValueError, match=r"messages\[1\].content holds '\\ud800' at index 3, a lone surrogate"):
        chat_token_ids(tokenizer, [{"role": "user", "content": "hi"}, {"role": "user", "content": "hi \ud800"}])


def test_bad_chat_messages_are_value_errors(tmp_path):
    tokenizer = load_tokenizer(str(tokenizer_folder(tmp_path, chat_template=SMOLLM_TEMPLATE)))
    with pytest.raises(ValueError, match="messages is empty"):
        tokenizer.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tokenizer.apply_chat_template(["hi"])
    with pytest.raises(ValueError, match="chat template failed"):
        tokenizer.apply_chat_template([{"role": "user"}])


def test_a_fast_folder_loads_and_chats_without_importing_transformers(tmp_path):
    folder = tokenizer_folder(tmp_path, chat_template=SMOLLM_TEMPLATE)
    check = (
        "import sys\n"
        "from fastgen.engine.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(folder)!r})\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
        "print(len(ids) > 0, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


@pytest.mark.parametrize("kind", ["byte-level", "fast byte-level", "sentencepiece"])
def test_token_bytes_join_back_into_the_text_where_tokens_split_characters(kind, tmp_path):
    """Each piece of a split character decodes alone to U+FFFD; their bytes join into it."""
    from fastgen.engine.tokenizer import token_bytes_reader

    if kind == "sentencepiece":
        tokenizer, text = sentencepiece_like_tokenizer(), "The quick fox ø ☃ 龍"
    else:
        tokenizer, text = build_tokenizer(), "Grüße aus Köln! 東京は晴れ。 🚀✨ café<|endoftext|>"
        if kind == "fast byte-level":
            tokenizer.save_pretrained(tmp_path)
            tokenizer = load_tokenizer(str(tmp_path))
            assert isinstance(tokenizer, FastTokenizer)
    token_bytes = token_bytes_reader(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)
    joined = b"".join(token_bytes(i) for i in ids).decode("utf-8")
    assert joined == (" " + text if kind == "sentencepiece" else text)  # (SentencePiece's leading "▁")


def test_token_bytes_are_unknown_for_a_decoder_it_does_not_read():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from fastgen.engine.tokenizer import token_bytes_reader

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    assert token_bytes_reader(PreTrainedTokenizerFast(tokenizer_object=backend))(1) is None
    assert token_bytes_reader(object())(1) is None


def test_encoding_lets_other_threads_run(tiny_models):
    """A long prompt is encoded without the GIL: another thread (the engine's loop, a server's
    event loop) keeps running meanwhile, where `tokenizers`' own `encode` would hold it whole."""
    tokenizer = load_tokenizer(tiny_models["llama"])
    text = " ".join(f"word{i} Grüße, {i * 7}!" for i in range(40_000))
    ticks, done = [0], threading.Event()

    def tick():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.0002)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.01)
        before = ticks[0]
        ids = tokenizer.encode(text)
        during = ticks[0] - before
    finally:
        done.set()
        ticker.join()
    assert ids == tokenizer.backend_tokenizer.encode(text).ids
    # Holding the GIL, the encode would let the ticker in at most once (at its start).
    assert during >= 5, f"the other thread ran {during} times while {len(ids):,} tokens were encoded"
