"""Sampling parameters (SGLang's names and defaults) and the batched sampler.

The sampler follows SGLang's order: the logit processors first (`penalize`: SGLang's repetition,
frequency and presence penalizers over the request's own output tokens, then `logit_bias`; the
engine adds the `min_new_tokens` mask), then temperature, then top-k, top-p and min-p filtering of
the probabilities, then one draw. Each request owns its random stream (`RequestRandom`): the uniforms
it consumes are drawn from its own `torch.Generator`, so a seeded request produces the same tokens
whatever else shares its batch. The draw is inverse-CDF sampling with one uniform per token.

Sampling-mask replay (SGLang's `return_sampling_mask`): `sample_with_support` returns, with the
tokens, what the draw came from — the support S = {i : w_i > 0} of the post-filter weights w of
each row and the processed log-prob log(w_y / Σ w) of the drawn token — read off the very tensor
the draw used, not rebuilt afterwards. A greedy row's support is {argmax} and its log-prob 0.
Because the penalties and the bias enter the logits before the draw, they are part of that
processed distribution (and of its support), as in SGLang.

`stop_regex` (SGLang's) ends a request when `re.search` finds a pattern in the decoded tail of its
output; `regex_tail_tokens` bounds that tail as SGLang's `get_max_seq_length` does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

try:  # Python >= 3.11
    import re._parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef, unused-ignore]  # the 3.10 module of the same API

import torch


@dataclass
class SamplingParams:
    """Per-request sampling controls, named and defaulted as SGLang's `SamplingParams`.

    `seed` and `sampling_seed` (SGLang's name) are the same thing: same seed -> same tokens,
    regardless of batch mates. `min_new_tokens` masks eos and stop tokens until that many tokens
    were generated, as in SGLang. The penalties and `logit_bias` are SGLang's logit processors (see
    `penalize`), with SGLang's ranges; `stop_regex` is a pattern or a list of them.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    sampling_seed: int | None = None
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0  # minus this x (times the token was generated)
    presence_penalty: float = 0.0  # minus this once a token was generated
    repetition_penalty: float = 1.0  # a generated token's logit: / this if > 0, x this if < 0
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> added to its logit
    stop_regex: list[str] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON `sampling_params` object; unknown keys and wrong types raise
        ValueError("sampling_params.<field>: ..."). JSON null means "the default", as in SGLang."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params: expected an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"sampling_params.{key}: unknown or unsupported field (known: {sorted(known)})")
        out = cls(**{k: v for k, v in d.items() if v is not None})
        out.check_types()
        return out

    def check_types(self) -> None:
        """Type checks (a bool is not an int here; an int is a valid float; a str stop -> [str])."""
        for name in ("max_new_tokens", "top_k", "min_new_tokens"):
            _expect_int(name, getattr(self, name))
        for name in ("seed", "sampling_seed"):
            if getattr(self, name) is not None:
                _expect_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"sampling_params.{name}: expected a number, got {v!r}")
            setattr(self, name, float(v))
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling_params.{name}: expected a boolean, got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(
                    f"sampling_params.stop: expected a non-empty string or a list of them, got {self.stop!r}"
                )
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple, set)):
                raise ValueError(
                    f"sampling_params.stop_token_ids: expected a list of ints, got {self.stop_token_ids!r}"
                )
            for t in self.stop_token_ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"sampling_params.stop_token_ids: expected ints, got {t!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if self.stop_regex is not None:
            if not isinstance(self.stop_regex, list) or not all(isinstance(s, str) and s for s in self.stop_regex):
                raise ValueError(
                    f"sampling_params.stop_regex: expected a non-empty string or a list of them, "
                    f"got {self.stop_regex!r}"
                )
            for pattern in self.stop_regex:
                try:
                    re.compile(pattern)
                except re.error as err:
                    raise ValueError(
                        f"sampling_params.stop_regex: {pattern!r} is not a valid regular expression ({err})"
                    ) from None

    def validate(self, context_length: int, prompt_len: int, vocab_size: int | None = None) -> None:
        """Raise ValueError("sampling_params.<field>: ...") for values SGLang would reject."""
        self.check_types()
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens: must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"sampling_params.min_new_tokens: must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"sampling_params.temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling_params.top_k: must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling_params.min_p: must be in [0, 1], got {self.min_p}")
        # SGLang's ranges and wording (SamplingParams.verify)
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"sampling_params.{name}: {name} must be in [-2, 2], got {getattr(self, name)}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                "sampling_params.repetition_penalty: repetition_penalty must be in (0, 2] (1.0 = no "
                f"penalty), got {self.repetition_penalty}."
            )
        if self.seed is not None and self.sampling_seed is not None and self.seed != self.sampling_seed:
            raise ValueError(
                f"sampling_params.sampling_seed: {self.sampling_seed} contradicts seed={self.seed} (give one)"
            )
        if vocab_size is not None:
            for t in self.stop_token_ids or []:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"sampling_params.stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
            for key in self.logit_bias or {}:
                if not 0 <= int(key) < vocab_size:
                    raise ValueError(
                        f"sampling_params.logit_bias: logit_bias must has keys in [0, {vocab_size - 1}], got {key}."
                    )
        if prompt_len >= context_length:
            raise ValueError(
                f"input_ids: the prompt has {prompt_len} tokens; context_length is {context_length} "
                "(the prompt must be shorter)"
            )

    @property
    def effective_seed(self) -> int | None:
        return self.sampling_seed if self.sampling_seed is not None else self.seed

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """A penalty or a logit bias changes this request's logits before the draw."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or any(v != 0.0 for v in (self.logit_bias or {}).values())
        )

    @property
    def logit_processors(self) -> list[str]:
        """The names of the fields that change this request's logits (for error messages)."""
        out = [
            n
            for n, off in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0))
            if getattr(self, n) != off
        ]
        return out + (["logit_bias"] if any(v != 0.0 for v in (self.logit_bias or {}).values()) else [])


def mask_replay_conflict(sp: SamplingParams) -> str:
    """Why `return_sampling_mask` is refused next to penalties or a logit bias: sampling-mask replay
    renormalises the trainer's log-probs over the support, which cannot reproduce per-token offsets
    (docs/serving.md, "Sampling masks")."""
    return (
        f"return_sampling_mask: cannot be combined with sampling_params.{', '.join(sp.logit_processors)} (the "
        "trainer's replay renormalises over the support and cannot reproduce per-token penalties or biases); "
        "drop them or the mask"
    )


def _expect_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"sampling_params.{name}: expected an integer, got {v!r}")


def _logit_bias(bias: Any) -> dict[str, float]:
    """SGLang's `logit_bias` ({token id: bias}; JSON keys are strings, an int key is taken too), checked."""
    if not isinstance(bias, dict):
        raise ValueError(f"sampling_params.logit_bias: expected an object {{token id: bias}}, got {bias!r}")
    out: dict[str, float] = {}
    for key, value in bias.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)) or not str(key).lstrip("-").isdigit():
            raise ValueError(f"sampling_params.logit_bias: keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"sampling_params.logit_bias: the bias of {key} must be a finite number, got {value!r}")
        out[str(int(key))] = float(value)
    return out


def penalize(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """SGLang's logit processors on fp32 `logits` [B, V], row j from `params[j]` and the tokens row j
    generated so far (`outputs[j]`; the prompt does not count, as in SGLang's penalizers):
    repetition penalty (a generated token's logit divided by it if positive, multiplied if
    negative), then frequency (minus penalty x count) and presence (minus penalty once) penalties,
    then `logit_bias` added. Returns `logits` itself when no row has any; rows without any are
    unchanged (each row is computed from its own inputs only)."""
    rows = [j for j, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab, dev, dt = logits.shape[-1], logits.device, logits.dtype
    sub = out[rows]  # [R, V], one row per request with processors, all rows at once
    longest = max(len(outputs[j]) for j in rows)
    if longest:
        ids = torch.full((len(rows), longest), vocab, dtype=torch.long)  # padded with an extra column
        for r, j in enumerate(rows):
            ids[r, : len(outputs[j])] = torch.tensor(outputs[j], dtype=torch.long)
        counts = torch.zeros(len(rows), vocab + 1, dtype=dt).scatter_add_(1, ids, torch.ones(ids.shape, dtype=dt))
        counts = counts[:, :vocab].to(dev)
        seen = counts > 0

        def column(name: str) -> torch.Tensor:
            return torch.tensor([[getattr(params[j], name)] for j in rows], dtype=dt, device=dev)

        rep = column("repetition_penalty")
        sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
        sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * seen.to(dt)
    for r, j in enumerate(rows):
        bias = params[j].logit_bias
        if bias:
            idx = torch.tensor([int(k) for k in bias], dtype=torch.long, device=dev)
            sub[r] = sub[r].index_add(0, idx, torch.tensor(list(bias.values()), dtype=dt, device=dev))
    out[rows] = sub
    return out


MAX_REGEX_TAIL = 1 << 30  # an unbounded pattern: the whole output


def regex_tail_tokens(patterns: list[str]) -> int:
    """Output tokens to decode when matching `patterns` at the end of the output: SGLang's bound
    (`get_max_seq_length`: at most one token per character a match can span), + 1 as SGLang's
    `tail_str`; `MAX_REGEX_TAIL` for a pattern without a bound."""
    return min(max(_max_match_len(sre_parse.parse(p)) for p in patterns), MAX_REGEX_TAIL) + 1


def _max_match_len(subpattern) -> int:
    total = 0
    for op, value in subpattern:
        if op in (sre_parse.LITERAL, sre_parse.NOT_LITERAL, sre_parse.IN, sre_parse.ANY):
            total += 1
        elif op == sre_parse.SUBPATTERN:
            total += _max_match_len(value[-1])
        elif op == sre_parse.BRANCH:
            total += max(_max_match_len(b) for b in value[1])
        elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT):
            low, high, inner = value
            total += MAX_REGEX_TAIL if high == sre_parse.MAXREPEAT else high * _max_match_len(inner)
        elif op in (sre_parse.AT, sre_parse.ASSERT, sre_parse.ASSERT_NOT):
            continue
        else:  # backreferences, conditionals: no bound known
            total += MAX_REGEX_TAIL
        total = min(total, MAX_REGEX_TAIL)
    return total


@dataclass
class RequestRandom:
    """A request's own uniform stream, drawn in blocks from its generator (cheap per token)."""

    generator: torch.Generator
    block: list[float] = field(default_factory=list)
    pos: int = 0

    @classmethod
    def seeded(cls, seed: int) -> RequestRandom:
        g = torch.Generator()
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        return cls(g)

    def next(self) -> float:
        if self.pos == len(self.block):
            self.block = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()
            self.pos = 0
        self.pos += 1
        return self.block[self.pos - 1]


@dataclass
class BatchSampling:
    """Per-row sampling controls of one batch, as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float; 0 rows are greedy
    top_k: torch.Tensor  # [B] long; vocab size when off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    any_filter: bool
    all_greedy: bool
    any_min_new_tokens: bool = True  # some row has min_new_tokens > 0 (its stop tokens may need masking)
    any_penalties: bool = True  # some row has a penalty or a logit bias (`penalize`)

    @classmethod
    def of(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> BatchSampling:
        temps = [0.0 if p.is_greedy else p.temperature for p in params]
        ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        ps = [p.top_p for p in params]
        mps = [p.min_p for p in params]
        greedy = all(t == 0.0 for t in temps)
        any_filter = not greedy and (
            any(k < vocab_size for k in ks) or any(p < 1.0 for p in ps) or any(m > 0 for m in mps)
        )
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(ks, dtype=torch.long, device=device),
            top_p=torch.tensor(ps, dtype=torch.float32, device=device),
            min_p=torch.tensor(mps, dtype=torch.float32, device=device),
            any_filter=any_filter,
            all_greedy=greedy,
            any_min_new_tokens=any(p.min_new_tokens > 0 for p in params),
            any_penalties=any(p.processes_logits for p in params),
        )


def sample(logits: torch.Tensor, ctl: BatchSampling, uniforms: torch.Tensor | None) -> torch.Tensor:
    """Next token per row of fp32 `logits` [B, V]; `uniforms` [B] in [0, 1) (ignored by greedy rows;
    may be None when every row is greedy).

    Each row is computed from its own logits, controls and uniform only, so a row's token does not
    depend on the rest of the batch.
    """
    greedy_tokens = logits.argmax(-1)
    if ctl.all_greedy:
        return greedy_tokens
    tokens, _ = _draw(logits, ctl, uniforms, greedy_tokens)
    return tokens


@dataclass
class SampledSupport:
    """What each row's token was drawn from (sampling-mask replay)."""

    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] float64: log(w_y / sum w), the processed log-prob; 0 for greedy rows
    sizes: torch.Tensor  # [B] long: |S| per row (1 for greedy rows)
    weights: torch.Tensor | None  # [B, V] the post-filter weights the draw used (None when all greedy)

    def support(self, row: int) -> list[int]:
        """The ids of S for `row`, ascending (a greedy row: its token)."""
        if self.weights is None or self.sizes[row] == 1:
            return [int(self.tokens[row])]
        return torch.nonzero(self.weights[row] > 0).squeeze(-1).tolist()


def sample_with_support(logits: torch.Tensor, ctl: BatchSampling, uniforms: torch.Tensor | None) -> SampledSupport:
    """`sample`, plus each row's support and processed log-prob, taken from the weights drawn from.

    Greedy rows (temperature 0 or top_k 1) have the singleton support {argmax} and log-prob 0.
    """
    greedy_tokens = logits.argmax(-1)
    ones = torch.ones_like(greedy_tokens)
    zeros = torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)
    if ctl.all_greedy:
        return SampledSupport(greedy_tokens, zeros, ones, None)
    tokens, probs = _draw(logits, ctl, uniforms, greedy_tokens)
    return support_of(tokens, probs, ctl)


def support_of(tokens: torch.Tensor, probs: torch.Tensor | None, ctl: BatchSampling) -> SampledSupport:
    """The `SampledSupport` of `tokens` drawn from the post-filter weights `probs` [B, V] (None: every
    row is greedy)."""
    ones = torch.ones_like(tokens)
    zeros = torch.zeros(tokens.shape[0], dtype=torch.float64, device=tokens.device)
    if probs is None:
        return SampledSupport(tokens, zeros, ones, None)
    greedy = ctl.temperature <= 0
    w = probs.double()
    logp = w.gather(-1, tokens[:, None]).squeeze(-1).log() - w.sum(-1).log()
    sizes = (probs > 0).sum(-1)
    return SampledSupport(tokens, torch.where(greedy, zeros, logp), torch.where(greedy, ones, sizes), probs)


def _draw(
    logits: torch.Tensor, ctl: BatchSampling, uniforms: torch.Tensor | None, greedy_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, the post-filter weights [B, V] the sampled rows drew from)."""
    probs = processed_weights(logits, ctl)
    if uniforms is None:
        raise ValueError("sampling: uniforms are needed unless every row is greedy")
    sampled = inverse_cdf(probs, uniforms)
    return torch.where(ctl.temperature > 0, sampled, greedy_tokens), probs


def processed_weights(logits: torch.Tensor, ctl: BatchSampling) -> torch.Tensor:
    """The post-filter weights w [B, V] a sampled row draws from: softmax(logits / T), then top-k,
    top-p and min-p zero what they drop (not renormalised; greedy rows as if T were 1). Speculative
    verification accepts drafts against exactly these (`speculative.py`)."""
    temp = torch.where(ctl.temperature > 0, ctl.temperature, torch.ones_like(ctl.temperature))
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if ctl.any_filter:
        probs_sorted, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        drop = rank >= ctl.top_k[:, None]
        # top_p == 1 must keep everything even where float cumsums overshoot 1.
        drop |= ((probs_sorted.cumsum(-1) - probs_sorted) > ctl.top_p[:, None]) & (ctl.top_p[:, None] < 1.0)
        drop |= probs_sorted < probs_sorted[:, :1] * ctl.min_p[:, None]
        # Back to vocabulary order, so a row's draw does not depend on whether the batch filters.
        probs = torch.zeros_like(probs).scatter_(-1, order, probs_sorted.masked_fill(drop, 0.0))
    return probs


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of the (unnormalised, non-negative) `weights` [B, V] with `uniforms` [B] in
    [0, 1): the first id whose cumulative weight exceeds u x the total, never past the last id of
    positive weight (the float edge of the CDF)."""
    cdf = weights.cumsum(-1)
    picked = torch.searchsorted(cdf, (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    vocab = torch.arange(weights.shape[-1], device=weights.device)
    last_kept = torch.where(weights > 0, vocab, 0).amax(-1)
    return torch.minimum(picked, last_kept)
