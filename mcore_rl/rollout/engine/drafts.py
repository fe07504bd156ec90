"""Drafters for speculative sampling: who proposes the tokens the target verifies (`speculative.py`).

Three kinds, SGLang's `--speculative-algorithm` names:

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
* `NEXTN` (the target's own MTP heads, `hf/mtp.py`; SGLang's name for DeepSeek's): depth 1 reads
  the target's last hidden state and the last token, each next step the previous step's hidden
  state and draft; q is the heads' processed distribution. The heads are the target's parameters,
  so the weight sync that updates the policy updates them (`MTPDrafter`).

A draft of a request depends on its own sequence, sampling controls and random stream only, so a
seeded request's tokens do not depend on its batch mates.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from mcore_rl.hf.mtp import project

from .kv_cache import PagedKVCache
from .model_runner import ModelRunner
from .sampling import BatchSampling, SamplingParams, inverse_cdf, processed_weights


@dataclass
class Draft:
    """One request's proposal: `tokens` (possibly none) and, for a model draft, the distribution
    [len(tokens), V] each was drawn from (None: point masses)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    match: int = 0  # prompt lookup: the length of the n-gram that matched (a confidence feature)


def draw_position(
    logits: torch.Tensor,
    ctl: BatchSampling,
    params: list[SamplingParams],
    lengths: list[int],
    j: int,
    uniforms: Callable[[int, int], list[float]],
    tokens: list[list[int]],
    probs: list[list[torch.Tensor]],
) -> torch.Tensor:
    """Draft position `j` of every slot from its [b, V] logits: the processed distribution, one
    uniform per sampling slot still drafting (greedy slots: argmax), appended to the slots whose
    budget reaches `j`. Returns the drawn ids [b] (every slot's, for the next forward)."""
    b = logits.shape[0]
    w = processed_weights(logits, ctl)
    u = torch.tensor(
        [uniforms(i, 1)[0] if j < lengths[i] and not params[i].is_greedy else 0.0 for i in range(b)],
        dtype=torch.float64,
        device=w.device,
    )
    drawn = torch.where(ctl.temperature > 0, inverse_cdf(w, u), logits.argmax(-1))
    for i in range(b):
        if j < lengths[i]:
            tokens[i].append(int(drawn[i]))
            probs[i].append(w[i])
    return drawn


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
        return [Draft(*self.match(seq, k)) for seq, k in zip(sequences, lengths)]

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier occurrence of seq's last n tokens (longest n first)."""
        return self.match(seq, k)[0]

    def match(self, seq: list[int], k: int) -> tuple[list[int], None, int]:
        """(`lookup`'s tokens, no q, the n that matched; 0 when none did)."""
        if k <= 0:
            return [], None, 0
        end = len(seq)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            tail = seq[end - n :]
            for start in range(end - n - 1, -1, -1):  # latest first; the match must end before the tail does
                if seq[start : start + n] == tail:
                    found = seq[start + n : start + n + k]
                    return found, None, n if found else 0
        return [], None, 0

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
        if self.runner.ngram_context is not None:
            raise ValueError(
                "speculative_draft_model_path: the draft model must have no n-gram embeddings (its "
                "multi-token catch-up pass does not cover Over-Encoding)"
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
            drawn = draw_position(step_logits, ctl, params, lengths, t, uniforms, tokens, probs).tolist()
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


class _HeadModel(nn.Module):
    """One MTP layer seen as a one-layer model of the target's shape (its shared head's norm as the
    final norm, the target's embedding and output layer), so a `ModelRunner` runs it over its own
    paged KV cache. The layer's parameters stay the target's (`mtp.layers.{d}.*`), so a weight load
    into the target updates them (the runner's fused q/k/v are views of them)."""

    def __init__(self, target: nn.Module, layer: nn.Module) -> None:
        super().__init__()
        tree: Any = target.model  # the reference model's modules by name (as ModelRunner reads them)
        head_layer: Any = layer  # its MTP parts joined by name (hf/mtp.py)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.model.norm = head_layer.shared_head.norm
        self.model.embed_tokens = tree.embed_tokens
        self.lm_head = target.lm_head
        config: Any = copy.copy(target.config)  # the target's HF config: its keys are dynamic attributes
        config.num_hidden_layers = 1
        layer_types = getattr(config, "layer_types", None)
        config.layer_types = [layer_types[-1]] if layer_types else None
        self.config = config


class MTPDrafter:
    """The target's own MTP heads (`hf/mtp.py`, SGLang's NEXTN): draft j comes from depth
    min(j, D) on the previous step's hidden state and token, so k > D steps reuse the last depth.

    Depth d (0-based) at position t reads the hidden state of depth d − 1 at t (depth 0: the
    target's final-normed hidden state, which the target's runner keeps, `ModelRunner.keep_hidden`)
    and the token at t + d + 1. Each depth has its own paged KV cache whose slots mirror the
    engine's; per step it catches up over the positions whose inputs became final (the tokens the
    target accepted), then the drafting steps write speculative positions that the next catch-up
    overwrites. q per drafted token is the heads' processed distribution under the request's own
    sampling controls. A weight sync updates the heads with the policy (they are the target's
    parameters); their caches are recomputed after it."""

    def __init__(
        self,
        target: nn.Module,
        target_runner: ModelRunner,
        *,
        num_slots: int,
        max_len: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        vocab_size: int,
        weights_epoch: Callable[[], int],
    ) -> None:
        heads: Any = getattr(target, "mtp", None)  # hf/mtp.py: MTPHeads
        if heads is None or len(heads.layers) == 0:
            raise ValueError(
                "speculative_algorithm: NEXTN drafts with the model's MTP heads, and this model has none "
                "(its config's mtp_num_layers is 0)"
            )
        self.layers: list[Any] = list(heads.layers)  # each with its MTP parts joined by name
        tree: Any = target.model  # the reference model's modules by name
        self.embed: Any = tree.embed_tokens
        self.target_hidden = target_runner.keep_hidden()
        self.runners = [
            ModelRunner(_HeadModel(target, layer), num_slots, max_len, dtype, device) for layer in self.layers
        ]
        for runner in self.runners:
            runner.allocate_cache(max_tokens)
            runner.keep_hidden()  # depth d's outputs: depth d + 1's input
        self.vocab_size, self.device, self.dtype = vocab_size, device, dtype
        self._weights_epoch, self._epoch = weights_epoch, weights_epoch()
        # per slot: the sequence the caches were computed from, and per depth how many positions hold
        # final K/V and outputs (position t of depth d depends on the sequence up to t + d + 1)
        self._seq: list[list[int]] = [[] for _ in range(num_slots)]
        self._done: list[list[int]] = [[0] * len(self.layers) for _ in range(num_slots)]
        self.forwards = 0  # head passes run (for the benchmark)

    def free(self, slot: int) -> None:
        for runner in self.runners:
            runner.kv.free(slot)
        self._seq[slot], self._done[slot] = [], [0] * len(self.layers)

    def move(self, src: int, dst: int) -> None:
        for runner in self.runners:
            runner.move(src, dst)
        self._seq[dst], self._done[dst] = self._seq[src], self._done[src]
        self._seq[src], self._done[src] = [], [0] * len(self.layers)

    def reset(self) -> None:
        for slot in range(len(self._seq)):
            self.free(slot)

    def _input(self, depth: int, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return project(self.layers[depth], hidden.to(self.dtype), self.embed(tokens))

    def _catch_up(self, depth: int, sequences: list[list[int]]) -> None:
        """Run depth `depth` over every slot's positions whose inputs are final and not yet run: t
        from its done count to len − 2 − depth. A slot with none runs one throwaway position at
        len − 1, which no depth counts as done."""
        runner, b = self.runners[depth], len(sequences)
        source = self.target_hidden if depth == 0 else self.runners[depth - 1].hidden
        assert source is not None  # kept since construction
        spans: list[tuple[int, int]] = []  # (first position, count) per slot
        for i, seq in enumerate(sequences):
            first, last = self._done[i][depth], len(seq) - 2 - depth
            spans.append((first, last - first + 1) if last >= first else (len(seq) - 1, 0))
        s = max(max(n, 1) for _, n in spans)
        embeds = torch.zeros(b, s, runner.hidden_size, dtype=self.dtype, device=self.device)
        for i, (first, n) in enumerate(spans):
            if n:
                at = torch.arange(first, first + n, device=self.device)
                tokens = torch.tensor(sequences[i][first + depth + 1 : first + depth + 1 + n], device=self.device)
                embeds[i, :n] = self._input(depth, source[i, at], tokens)
        runner.extend([[0] * max(n, 1) for _, n in spans], [first for first, _ in spans], embeds)
        self.forwards += 1
        for i, (first, n) in enumerate(spans):
            if n:
                self._done[i][depth] = first + n

    @torch.inference_mode()
    def propose(
        self,
        sequences: list[list[int]],
        lengths: list[int],
        params: list[SamplingParams],
        uniforms: Callable[[int, int], list[float]],
    ) -> list[Draft]:
        b = len(sequences)
        lengths = [k if len(seq) >= 2 else 0 for seq, k in zip(sequences, lengths)]  # depth 0 reads len − 2
        k = max(lengths, default=0)
        if k <= 0:
            return [Draft([]) for _ in sequences]
        if self._weights_epoch() != self._epoch:  # new weights: derived tables, and every cached position
            self._epoch = self._weights_epoch()
            for runner in self.runners:
                runner.refresh()
            self.reset()
        for i, seq in enumerate(sequences):
            common = 0
            old = self._seq[i]
            while common < min(len(old), len(seq)) and old[common] == seq[common]:
                common += 1
            self._done[i] = [min(done, max(0, common - d - 1)) for d, done in enumerate(self._done[i])]
            self._seq[i] = list(seq)
            for runner in self.runners:  # catch-up, drafts and the throwaway position stay below len + k
                if not runner.kv.reserve(i, len(seq) + lengths[i]):
                    return [Draft([]) for _ in sequences]  # the heads' pool is full: plain decoding this step
        depths = len(self.runners)
        for d in range(depths):
            self._catch_up(d, sequences)
        rows = torch.arange(b, device=self.device)
        last = torch.tensor([max(len(seq) - 2, 0) for seq in sequences], device=self.device)
        depth0 = self.runners[0].hidden
        assert depth0 is not None  # kept since construction
        hidden = depth0[rows, last]  # depth 0's output at len − 2: it predicts the token at len
        ctl = BatchSampling.of(params, self.vocab_size, self.device)
        tokens: list[list[int]] = [[] for _ in range(b)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(b)]
        for j in range(k):
            logits = self.runners[min(j, depths - 1)].head(hidden)
            drawn = draw_position(logits, ctl, params, lengths, j, uniforms, tokens, probs)
            if j == k - 1:
                break
            d = min(j + 1, depths - 1)  # the depth of draft j + 2, at len − 2 + (j + 1 − d)
            positions = [
                len(seq) - 2 + (j + 1 - d) if j + 1 < lengths[i] else len(seq) - 1 for i, seq in enumerate(sequences)
            ]
            runner = self.runners[d]
            runner.extend([[0]] * b, positions, self._input(d, hidden, drawn)[:, None])
            self.forwards += 1
            assert runner.last_normed is not None  # set by that extend
            hidden = runner.last_normed[:, 0]
        return [Draft(tokens[i], torch.stack(probs[i]) if probs[i] else None) for i in range(b)]


class BlockDrafter:
    """DSpark's semi-autoregressive drafter (`dflash.BlockHead`, in process: `EngineCore(...,
    speculative=SpeculativeSettings("DFLASH"), draft_model=head)`): one parallel pass gives the base
    logits U_1..U_k of every running request from the target's hidden state before its last token
    (kept by the target's runner, as NEXTN's) and that token; then draft j is drawn left to right from
    the processed softmax(U_j + W1[x_{j-1}] W2) under the request's controls, which is q_j. No KV
    cache of its own: nothing to free, move or reset. Its weights are fixed (no weight sync)."""

    def __init__(self, head: nn.Module, target_runner: ModelRunner, *, vocab_size: int, device: torch.device) -> None:
        head_any: Any = head
        if int(getattr(head_any, "vocab_size", -1)) != vocab_size:
            raise ValueError(
                "speculative_algorithm: DFLASH needs a dflash.BlockHead of the target's vocabulary as the draft model"
            )
        self.head: Any = head.to(device).eval()
        for p in self.head.parameters():
            p.requires_grad_(False)
        self.target_hidden = target_runner.keep_hidden()
        self.vocab_size, self.device = vocab_size, device
        self.forwards = 0

    def free(self, slot: int) -> None:
        return None

    def move(self, src: int, dst: int) -> None:
        return None

    def reset(self) -> None:
        return None

    @torch.inference_mode()
    def propose(
        self,
        sequences: list[list[int]],
        lengths: list[int],
        params: list[SamplingParams],
        uniforms: Callable[[int, int], list[float]],
    ) -> list[Draft]:
        b = len(sequences)
        lengths = [min(k, self.head.block) if len(seq) >= 2 else 0 for seq, k in zip(sequences, lengths)]
        k = max(lengths, default=0)
        if k <= 0:
            return [Draft([]) for _ in sequences]
        rows = torch.arange(b, device=self.device)
        before = torch.tensor([max(len(seq) - 2, 0) for seq in sequences], device=self.device)
        anchor = torch.tensor([seq[-1] for seq in sequences], device=self.device)
        base = self.head.base_logits(self.target_hidden[rows, before], anchor)  # [b, block, V]: one pass
        self.forwards += 1
        ctl = BatchSampling.of(params, self.vocab_size, self.device)
        prev = anchor
        tokens: list[list[int]] = [[] for _ in range(b)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(b)]
        for j in range(k):
            logits = base[:, j] + self.head.bias(prev)
            prev = draw_position(logits, ctl, params, lengths, j, uniforms, tokens, probs)
        return [Draft(tokens[i], torch.stack(probs[i]) if probs[i] else None) for i in range(b)]
