"""The model folder's tokenizer, and the token ids that end generation.

Most folders carry a `tokenizer.json` for the `tokenizers` library and a generic
`tokenizer_config.json`; those load straight into `tokenizers` (a tenth of a second) with the
chat template rendered by jinja2 as transformers renders it (`chat_template.py`). Folders that
need one of transformers' model-specific tokenizer classes, or settings this path does not
model, load through transformers' `AutoTokenizer` instead (seconds): same ids either way.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from fastgen.engine.chat_template import render_chat
from fastgen.models.config import ModelConfig, read_json
from fastgen.models.config_keys import ConfigKeys

# Files that carry a vocabulary; without one, transformers 5 silently builds an empty tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# tokenizer_config.json classes that add nothing to the tokenizer.json they are built from.
_GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", None}
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json settings whose effect depends on transformers' class and version (it
# ignores some of them for some tokenizers): folders that set them load through transformers.
_SETTINGS_LEFT_TO_TRANSFORMERS = ("add_bos_token", "add_eos_token", "add_prefix_space")


class FastTokenizer:
    """The part of a transformers tokenizer fastgen uses, over a `tokenizers.Tokenizer`:
    encode, decode, get_vocab, apply_chat_template, the named special tokens and `eos_token_id`."""

    def __init__(self, backend, config: dict):
        self.backend_tokenizer = backend
        self.chat_template = _chat_template(config)
        self.clean_up_tokenization_spaces = False  # folders that ask for it load through transformers
        self.special_tokens_map = {name: _token_text(config[name]) for name in _NAMED_SPECIAL_TOKENS
                                   if config.get(name) is not None}
        for name, text in self.special_tokens_map.items():
            setattr(self, name, text)
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = backend.token_to_id(eos) if eos is not None else None
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call, not `encode`: it lets go of the GIL while it runs (a long prompt takes
        # milliseconds, and every other thread, the engine's steps among them, would wait), and
        # computes no character offsets.
        return self.backend_tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab()

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False, tools: list[dict] | None = None):
        """The conversation rendered by the model's template: text (tokenize=False), token ids,
        or {"input_ids": ids} (return_dict=True), as transformers returns them."""
        if self.chat_template is None:
            raise ValueError("the model's tokenizer has no chat template")
        text = render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens_map, tools)
        if not tokenize:
            return text
        # The template writes any BOS itself; letting encode() add another would double it.
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids


def _token_text(value) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _read_json(path: Path) -> dict:
    """A tokenizer settings file's object; {} when absent (ValueError naming it when malformed)."""
    if not path.is_file():
        return {}
    content = read_json(path)
    if not isinstance(content, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return content


def load_fast_tokenizer(model: str) -> FastTokenizer | None:
    """The folder's tokenizer through `tokenizers`, or None when it needs transformers."""
    folder = Path(model)
    if not (folder / "tokenizer.json").is_file():
        return None
    config = {**_read_json(folder / "special_tokens_map.json"), **_read_json(folder / "tokenizer_config.json")}
    if (folder / "chat_template.jinja").is_file():
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
    if (config.get("tokenizer_class") not in _GENERIC_CLASSES or config.get("clean_up_tokenization_spaces")
            or any(key in config for key in _SETTINGS_LEFT_TO_TRANSFORMERS)):
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if backend.truncation is not None or backend.padding is not None or backend.post_processor is None:
        return None
    # transformers adds named special tokens missing from the vocabulary; leave that to it.
    for name in _NAMED_SPECIAL_TOKENS:
        if config.get(name) is not None and backend.token_to_id(_token_text(config[name])) is None:
            return None
    if not _added_tokens_agree(config.get("added_tokens_decoder"), backend.get_added_tokens_decoder()):
        return None  # transformers takes tokenizer_config.json's word (which tokens are special)
    return FastTokenizer(backend, config)


def _added_tokens_agree(listed, added) -> bool:
    """Whether tokenizer_config.json's added_tokens_decoder (if any) says what tokenizer.json's
    added tokens say, for each id it lists: text, special flag and how it matches (transformers
    builds an AddedToken of each entry, a missing flag at its default, and takes its word)."""
    if not isinstance(listed, dict):
        return True
    for key, entry in listed.items():
        token = added.get(int(key)) if str(key).isdigit() else None
        if token is None or not isinstance(entry, dict):
            return False
        special = entry.get("special", False)
        said = (entry.get("content"), special, entry.get("lstrip", False), entry.get("rstrip", False),
                entry.get("single_word", False), entry.get("normalized", not special))
        if said != (token.content, token.special, token.lstrip, token.rstrip, token.single_word, token.normalized):
            return False
    return True


def load_tokenizer(model: str):
    """A FastTokenizer when the folder allows it, else transformers' AutoTokenizer."""
    if not any((Path(model) / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"model={model!r}: could not load its tokenizer (none of {list(_TOKENIZER_FILES)} found; "
            "pass skip_tokenizer_init=True to serve token ids only)"
        )
    try:
        fast = load_fast_tokenizer(model)
        if fast is not None:
            return fast
        from transformers import AutoTokenizer  # seconds to import: only for folders that need it

        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"model={model!r}: could not load its tokenizer ({exc})") from exc


def token_bytes_reader(tokenizer) -> Callable[[int], bytes | None]:
    """token id -> the bytes the token stands for, or None where the tokenizer's decoder is not one
    this reads (a caller then encodes the token's text). A token that holds part of a character
    (a byte-level piece, or `<0xE2>` under byte fallback) decodes alone to U+FFFD; its bytes are
    what lets a reader rebuild the character (OpenAI's logprobs `bytes`). Byte-level BPE (GPT-2,
    Llama 3, Qwen, SmolLM) maps each byte to a printable character; SentencePiece-style folders
    write a space as "▁" and a byte as `<0xHH>`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda token_id: None
    kinds = decoder_steps(backend)
    if kinds is None:
        return lambda token_id: None
    added = {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()}
    byte_of = {char: byte for byte, char in _printable_bytes().items()}

    def byte_level(piece: str) -> bytes | None:
        if all(char in byte_of for char in piece):
            return bytes(byte_of[char] for char in piece)
        return None

    def sentencepiece(piece: str) -> bytes:
        if "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    if "ByteLevel" in kinds:
        read = byte_level
    elif kinds & {"Metaspace", "ByteFallback", "Replace"}:
        read = sentencepiece
    else:
        return lambda token_id: None

    def token_bytes(token_id: int) -> bytes | None:
        if token_id in added:
            return added[token_id].encode("utf-8")
        piece = backend.id_to_token(token_id)
        return None if piece is None else read(piece)

    return token_bytes


def decoder_steps(backend) -> set[str] | None:
    """The types of a `tokenizers.Tokenizer`'s decoder steps ("ByteLevel", "ByteFallback",
    "Metaspace", ...): a Sequence's members, or the one decoder; empty without a decoder; None
    where it cannot be read."""
    if backend.decoder is None:
        return set()
    try:
        decoder = json.loads(backend.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a decoder this tokenizers version cannot serialise
        return None
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return {step.get("type") for step in steps}


@functools.cache
def _printable_bytes() -> dict[int, str]:
    """Byte-level BPE's byte -> character map (GPT-2's `bytes_to_unicode`): printable bytes stand
    for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def eos_token_ids(model: str, model_config: ModelConfig, tokenizer) -> set[int]:
    """The ids that end generation, as transformers' generate() reads them: generation_config's
    eos_token_id when the folder has one, else config.json's, else the tokenizer's."""
    gen_file = Path(model) / "generation_config.json"
    if gen_file.is_file():
        eos = ConfigKeys(read_json(gen_file), str(gen_file)).token_ids("eos_token_id")
        if eos:
            return set(eos)
    if model_config.eos_token_ids:
        return set(model_config.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if eos is not None else set()
