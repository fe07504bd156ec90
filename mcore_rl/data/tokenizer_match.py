"""Whether two tokenizers give the same ids for the same text, and the same text for the same ids.

A model that reads the policy's token ids (a teacher, a reward model) must share the policy's
tokenizer: one trained with another would score other text than the policy wrote, and a vocabulary
of the same size says nothing about that. The probes are compared here for two tokenizers in one
process; `rollout/teacher.py: check_tokenizer` compares the same probes over a server's
`/tokenize` and `/detokenize`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mcore_rl.data.tokenizer import TOKENIZER_FILE, Tokenizer

# Texts whose token ids the other tokenizer must give exactly as the policy's does: words, digits,
# whitespace runs, multi-byte unicode, code. The tokenizer's special-token strings are added.
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "12 + 345 = 357; 3.14159 -> 2,718",
    "  two leading spaces\tand\ttabs\n\nand blank lines\n",
    "naïve café — Größe, 日本語, emoji 🙂",
    "def f(x):\n    return {'a': [x ** 2]}\n",
)
PROBE_IDS = 64  # ids spread over the vocabulary that must decode to the same text

# The files a model directory holds its tokenizer in (ours, or a Hugging Face one).
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir: str) -> bool:
    """True when `model_dir` holds a tokenizer `load_tokenizer` can read."""
    return any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES)


def special_ids(tokenizer: Tokenizer) -> list[int]:
    """The tokenizer's BOS, EOS and padding ids (those it has)."""
    ids = (getattr(tokenizer, "bos_id", None), tokenizer.eos_id, getattr(tokenizer, "pad_id", None))
    return [i for i in ids if i is not None]


def probe_texts(tokenizer: Tokenizer) -> list[str]:
    """`PROBE_TEXTS` and the tokenizer's special-token strings."""
    return list(PROBE_TEXTS) + [tokenizer.decode([i]) for i in special_ids(tokenizer)]


def probe_ids(tokenizer: Tokenizer) -> list[int]:
    """`PROBE_IDS` ids spread over the vocabulary, its last id and its special ids."""
    vocab = int(tokenizer.vocab_size)
    step = max(1, vocab // PROBE_IDS)
    return sorted(set(range(0, vocab, step)) | {vocab - 1} | set(special_ids(tokenizer)))


def tokenizer_difference(policy: Tokenizer, other: Tokenizer) -> str | None:
    """None when `other` encodes the probe texts to the policy's ids and decodes the probe ids to
    the policy's text; else the first difference, said in one line."""
    for text in probe_texts(policy):
        mine, theirs = list(policy.encode(text)), list(other.encode(text))
        if mine != theirs:
            return f"{text!r} encodes to {short_ids(theirs)}, the policy's tokenizer gives {short_ids(mine)}"
    for i in probe_ids(policy):
        mine_text = policy.decode([i], skip_special_tokens=False)
        try:
            theirs_text = other.decode([i], skip_special_tokens=False)
        except (IndexError, KeyError, ValueError, OverflowError) as err:  # an id past its vocabulary
            return f"token {i} does not decode ({type(err).__name__}), the policy's tokenizer gives {mine_text!r}"
        if theirs_text != mine_text:
            return f"token {i} decodes to {theirs_text!r}, the policy's tokenizer gives {mine_text!r}"
    return None


def short_ids(ids: Sequence[int]) -> str:
    """A list of ids for a one-line message: the first 16 and the count."""
    ids = list(ids)
    return str(ids) if len(ids) <= 16 else f"{ids[:16]}... ({len(ids)} ids)"
