"""Drafters for speculative sampling: who proposes the tokens the target verifies (`speculative.py`).

Two kinds, SGLang's `--speculative-algorithm` names:

* `NGRAM` (prompt lookup, Saxena's "Prompt Lookup Decoding"; vLLM's and SGLang's n-gram drafts): the
  last n tokens of the sequence (n from `max_ngram` down to `min_ngram`) are looked up in the
  sequence itself, prompt and output; the k tokens that followed their latest earlier occurrence
  are the draft. No model, a point-mass q. It pays where outputs copy their context (code edits,
  quoting, repeated structure) and costs one wider forward where they do not.
* `STANDALONE` (a small separate draft model with the target's tokenizer): k tokens drawn
  autoregressively from the draft model's processed distribution (the request's temperature,
  top-k, top-p, min-p over the draft's logits), which `speculative.verify_position` needs as q.
  It keeps its own paged KV cache whose slots mirror the engine's (`free`, `move`, `reset`), and
  catches up on the tokens the target accepted with one batched `ModelRunner.extend` per step.
  Its weights are fixed: a weight sync updates the target only, so acceptance, never exactness,
  drifts as the policy moves away from the draft.

A draft of a request depends on its own sequence, sampling controls and random stream only, so a
seeded request's tokens do not depend on its batch mates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .kv_cache import PagedKVCache
from .model_runner import ModelRunner
from .sampling import BatchSampling, SamplingParams, inverse_cdf, processed_weights


@dataclass
class Draft:
    """One request's proposal: `tokens` (possibly none) and, for a model draft, the distribution
    [len(tokens), V] each was drawn from (None: point masses)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """What `EngineCore` asks of a drafter; slots are the engine's KV slots (0..B-1 while running)."""

    def propose(
        self,
        sequences: list[list[int]],
        lengths: list[int],
        params: list[SamplingParams],
        uniforms: Callable[[int, int], list[float]],
    ) -> list[Draft]:
        """Drafts for slots 0..B-1: `sequences[i]` is slot i's prompt + output so far, `lengths[i]` the
        most tokens to propose, `uniforms(i, n)` n draws from slot i's own random stream."""
        ...

    def free(self, slot: int) -> None: ...

    def move(self, src: int, dst: int) -> None: ...

    def reset(self) -> None: ...


class NgramDrafter:
    """Prompt lookup: the continuation of the latest earlier match of the sequence's last n tokens."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(
        self,
        sequences: list[list[int]],
        lengths: list[int],
        params: list[SamplingParams],
        uniforms: Callable[[int, int], list[float]],
    ) -> list[Draft]:
        return [Draft(self.lookup(seq, k)) for seq, k in zip(sequences, lengths)]

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier occurrence of seq's last n tokens (longest n first)."""
        if k <= 0:
            return []
        end = len(seq)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            tail = seq[end - n :]
            for start in range(end - n - 1, -1, -1):  # latest first; the match must end before the tail does
                if seq[start : start + n] == tail:
                    return seq[start + n : start + n + k]
        return []

    def free(self, slot: int) -> None:
        return None

    def move(self, src: int, dst: int) -> None:
        return None

    def reset(self) -> None:
        return None


class ModelDrafter:
    """A small draft model of the target's vocabulary, with its own KV cache mirroring the engine's slots."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_slots: int,
        max_len: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        draft_vocab = int(getattr(model.config, "vocab_size", -1))
        if draft_vocab != vocab_size:
            raise ValueError(
                f"speculative_draft_model_path: the draft model's vocab_size {draft_vocab} != the target's "
                f"{vocab_size} (a draft must share the target's tokenizer)"
            )
        self.model = model.to(device=device, dtype=dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.runner = ModelRunner(self.model, num_slots, max_len, dtype, device)
        if self.runner.latent_cache or self.runner.ngram_context is not None:
            raise ValueError(
                "speculative_draft_model_path: the draft model must be a GQA decoder without n-gram "
                "embeddings (its multi-token catch-up pass does not cover latent caches or Over-Encoding)"
            )
        self.cache: PagedKVCache = self.runner.allocate_cache(max_tokens)
        self.vocab_size = vocab_size
        self.device = device
        # per slot: the tokens whose K/V the draft cache holds, in order (a prefix of the sequence,
        # then drafted tokens that the target may or may not have accepted)
        self._cached: list[list[int]] = [[] for _ in range(num_slots)]
        self.forwards = 0  # draft passes run (for the benchmark)

    def free(self, slot: int) -> None:
        self.cache.free(slot)
        self._cached[slot] = []

    def move(self, src: int, dst: int) -> None:
        self.runner.move(src, dst)
        self._cached[dst], self._cached[src] = self._cached[src], []

    def reset(self) -> None:
        for slot in range(len(self._cached)):
            self.free(slot)

    def _valid(self, slot: int, seq: list[int]) -> int:
        """Positions of the draft cache that still hold K/V of `seq` (the common prefix)."""
        cached = self._cached[slot]
        n = min(len(cached), len(seq) - 1)  # the last token is always fed again: its logits start the draft
        i = 0
        while i < n and cached[i] == seq[i]:
            i += 1
        return i

    @torch.inference_mode()
    def propose(
        self,
        sequences: list[list[int]],
        lengths: list[int],
        params: list[SamplingParams],
        uniforms: Callable[[int, int], list[float]],
    ) -> list[Draft]:
        b = len(sequences)
        k = max(lengths, default=0)
        if k <= 0:
            return [Draft([]) for _ in sequences]
        starts = [self._valid(i, seq) for i, seq in enumerate(sequences)]
        # Slot i writes positions len(seq) .. len(seq) + max(lengths[i], 1) - 1 and no further: its
        # drafted tokens but the last, then (while others still draft) a throwaway write at the next
        # position, never recorded as cached. All inside its budget, so inside the context.
        for i, seq in enumerate(sequences):
            if not self.cache.reserve(i, len(seq) + max(lengths[i], 1)):
                return [Draft([]) for _ in sequences]  # the draft pool is full: plain decoding this step
        ctl = BatchSampling.of(params, self.vocab_size, self.device)
        logits = self.runner.extend([seq[s:] for seq, s in zip(sequences, starts)], starts)  # [b, s_max, V]
        last = torch.tensor([len(seq) - s - 1 for seq, s in zip(sequences, starts)], device=logits.device)
        step_logits = logits[torch.arange(b, device=logits.device), last]
        self.forwards += 1
        for i, seq in enumerate(sequences):
            self._cached[i] = list(seq)
        tokens: list[list[int]] = [[] for _ in range(b)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(b)]
        for t in range(k):
            w = processed_weights(step_logits, ctl)
            u = torch.tensor(
                [uniforms(i, 1)[0] if t < lengths[i] and not params[i].is_greedy else 0.0 for i in range(b)],
                dtype=torch.float64,
                device=w.device,
            )
            drawn = torch.where(ctl.temperature > 0, inverse_cdf(w, u), step_logits.argmax(-1)).tolist()
            for i in range(b):
                if t < lengths[i]:
                    tokens[i].append(drawn[i])
                    probs[i].append(w[i])
            if t == k - 1:
                break
            positions = []
            for i, seq in enumerate(sequences):
                if t + 1 < lengths[i]:  # slot i drafts another token: its K/V of this one are kept
                    positions.append(len(seq) + t)
                    self._cached[i].append(drawn[i])
                else:
                    positions.append(len(seq) + max(lengths[i], 1) - 1)
            step_logits = self.runner.decode(drawn, positions)
            self.forwards += 1
        return [Draft(tokens[i], torch.stack(probs[i]) if probs[i] else None) for i in range(b)]
