"""Tokenizers behind one small interface: the project's byte-level tokenizer, or a local HF one.

The byte-level tokenizer needs no download and round-trips any unicode text (ids 0..255 are the
UTF-8 bytes), which is what CPU tests and demos need. Ids 256.. are special tokens, padded with
reserved ones to 384 so that it matches the default `ModelConfig.vocab_size`.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: transformers loads with the first HF tokenizer
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILE = "mcore_rl_tokenizer.json"
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tokenizer")

NUM_BYTES = 256
DEFAULT_VOCAB_SIZE = 384
NAMED_SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]


class Tokenizer(Protocol):
    """What the data pipeline, rollouts and rewards rely on, whichever tokenizer is behind it."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes plus named special tokens; special-token strings in text encode to their ids."""

    def __init__(self, special_tokens: list[str], vocab_size: int) -> None:
        if NUM_BYTES + len(special_tokens) != vocab_size:
            raise ValueError(f"{len(special_tokens)} special tokens + {NUM_BYTES} bytes != vocab_size {vocab_size}")
        self.special_tokens = list(special_tokens)
        self.vocab_size = vocab_size
        self._special_to_id = {tok: NUM_BYTES + i for i, tok in enumerate(special_tokens)}
        # Only the named tokens are matched in text; reserved ones stay plain bytes.
        named = [t for t in NAMED_SPECIAL_TOKENS if t in self._special_to_id]
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(named, key=len, reverse=True)) + ")")
        self.pad_id = self._special_to_id["<pad>"]
        self.bos_id: int | None = self._special_to_id["<bos>"]
        self.eos_id = self._special_to_id["<eos>"]

    @classmethod
    def default(cls) -> ByteTokenizer:
        reserved = [f"<|reserved_{i}|>" for i in range(DEFAULT_VOCAB_SIZE - NUM_BYTES - len(NAMED_SPECIAL_TOKENS))]
        return cls(NAMED_SPECIAL_TOKENS + reserved, DEFAULT_VOCAB_SIZE)

    def token_to_id(self, token: str) -> int:
        return self._special_to_id[token]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens` is accepted for the HF interface: this tokenizer adds none."""
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self._special_to_id:
                ids.append(self._special_to_id[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < NUM_BYTES:
                buf.append(i)
                continue
            # Flush bytes first so a multi-byte character is never split around a special token.
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if not skip_special_tokens:
                out.append(self.special_tokens[i - NUM_BYTES])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save(self, directory: str) -> str:
        """Write `mcore_rl_tokenizer.json` into `directory` (e.g. next to a checkpoint)."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, TOKENIZER_FILE)
        spec = {
            "type": "byte",
            "version": 1,
            "vocab_size": self.vocab_size,
            "num_byte_tokens": NUM_BYTES,
            "special_tokens": self.special_tokens,
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec, f, indent=1)
            f.write("\n")
        return path

    @classmethod
    def from_file(cls, path: str) -> ByteTokenizer:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        if spec.get("type") != "byte" or spec.get("num_byte_tokens") != NUM_BYTES:
            raise ValueError(f"{path}: not an mcore_rl byte tokenizer file")
        return cls(spec["special_tokens"], spec["vocab_size"])


class HFTokenizer:
    """A local Hugging Face tokenizer behind the same interface (no special tokens added by encode)."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self._tok = tok
        self.vocab_size = len(tok)
        if tok.eos_token_id is None:
            raise ValueError(f"tokenizer {tok.name_or_path!r} has no eos token")
        self.eos_id = tok.eos_token_id
        self.bos_id = tok.bos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    @property
    def has_chat_template(self) -> bool:
        return getattr(self._tok, "chat_template", None) is not None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> Any:  # the text, or with tokenize=True its ids (transformers' own union)
        """The model's own chat format (the server falls back to ChatML when there is none);
        `template_kwargs` go to the template (`continue_final_message`, `enable_thinking`, ...)."""
        if not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template")
        return self._tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **template_kwargs
        )


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """None -> the bundled byte tokenizer; a dir (or file) with our JSON -> ours; else a local HF dir."""
    if path is None:
        return ByteTokenizer.from_file(os.path.join(BUNDLED_DIR, TOKENIZER_FILE))
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    if os.path.isfile(path) and os.path.basename(path) == TOKENIZER_FILE:
        return ByteTokenizer.from_file(path)
    if os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        return ByteTokenizer.from_file(os.path.join(path, TOKENIZER_FILE))
    from transformers import AutoTokenizer  # slow import; only for real HF tokenizers

    return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
