"""Checks that fastgen's tokenizer gives what transformers' AutoTokenizer gives on one folder."""

from __future__ import annotations

from transformers import AutoTokenizer

from fastgen.engine.tokenizer import FastTokenizer, load_tokenizer

TEXTS = [
    "Hello, world!", " leading space", "trailing space ", "", "  two  spaces\tand a tab\nnew line",
    "Grüße aus Köln! 東京は晴れ。 Emoji: 🚀✨ café naïve", "def f(x):\n    return x ** 2  # square\n",
    "don't stop , it 's fine . ok ?", "<|endoftext|> inside text <|endoftext|>", "<|im_start|>user\nhi<|im_end|>",
    "1234567890 3.14159 -42", "a" * 300,
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 🚀"},
     {"role": "user", "content": "Again, with unicode: Grüße"}],
]


def assert_same_as_transformers(folder) -> FastTokenizer:
    ours = load_tokenizer(str(folder))
    assert isinstance(ours, FastTokenizer), "this folder should load without transformers"
    theirs = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.special_tokens_map == theirs.special_tokens_map
    if theirs.chat_template is not None:
        for chat in CHATS:
            for prompt in (True, False):
                text = theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
                assert ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == text
                ids = theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
                assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == list(ids)
    return ours
