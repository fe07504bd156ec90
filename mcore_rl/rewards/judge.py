"""Rewards that an LLM judge gives, asked through SGLang's native `/generate` API.

The judge is any server that speaks SGLang's `/generate` (`sglang.launch_server`, `sglang-router`,
`mcore-rl serve`): the same API the trainer's rollouts use. `rewards` must not import `rollout`
(docs/architecture.md), so the few lines of the wire format live here: a request
`{"text": str | [str], "sampling_params": {"max_new_tokens", "temperature", ...}}` and a response
`{"text", "meta_info": {"finish_reason": {"type": ...}}}` (a list of those for a batch), with
`Authorization: Bearer <api_key>` when the server has `--api-key`.

Every judge prompt and every parser is in `TEMPLATES` below, and nowhere else. Four rewards:

- `llm_judge` (`llm_judge_reward`): template → judge completion → parsed score, normalised to [0, 1];
- `rubric` (`rubric_reward`, DR-Rubric): one 0/1 verdict per rubric constraint (one batched
  `/generate` call per sample), reward = the mean verdict;
- `exprl_judge` (`exprl_reward`, ExpRL-Outcome): a 1–5 score of the response against the reference
  solution, s = (s̃ - 1) / 4;
- `exprl_process` (`exprl_process_reward`, ExpRL-Process): the same score for every prefix that
  ends at a "###" segment delimiter; reward = s_T, the per-segment delta advantages in the info.

A judge that answers without a verdict — an unparsable, empty, out-of-range or truncated reply —
scores the sample as the lowest point of its scale (`on_bad_verdict: lowest`, the default), counted
in the sample's info (`judge_unparsed`, the replies of that sample without a verdict; the run's
`reward/judge_unparsed_frac`): the response is part of the judge's prompt, so a policy could steer
the judge into such replies, and an error would leave the sample out of the loss — a low score
escaped. `on_bad_verdict: error` makes it an error instead. A judge that does not answer — an HTTP
error, a timeout, a dead server, an aborted reply — raises `JudgeError` (or aiohttp's / asyncio's
error): the reward runner (`base.py`) turns that into `reward_error` on that one sample; nothing is
retried and no other sample is touched. A rubric sample with one bad verdict under `error` is an
error as a whole (a mean over the verdicts that happened to parse would be a different reward).

Options are keyword arguments, as a recipe's reward options reach them: `fn(sample, **options)`.
Every judge takes `JudgeServer`'s (url, max_tokens, temperature, timeout, api_key, chat_format,
accept_truncated, sampling) and its own (template, prompt, and rubric / reference / delimiter /
norm). `check_options(name, options)` refuses, naming the option, what would fail on every
sample; `judge_reward_fn(name, **options)` checks and binds them into a `RewardFunction` whose
runner timeout (the HTTP timeout + 5 s) lets the judge's own timeout speak first.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import re
import string
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import aiohttp

from mcore_rl.rewards.base import RewardFunction, RewardInput


class JudgeError(ValueError):
    """The judge gave no usable verdict for this sample (the message says why)."""


class JudgeRefused(JudgeError):
    """The judge server refused the request as bad (HTTP 400: e.g. a prompt longer than its context)."""


# ---------------------------------------------------------------------------- parsing

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
# "Score: 7", "**Score:** 7", "score = 7/10", "Rating: [[7]]"
_SCORE_RE = re.compile(
    rf"\b(?:score|rating)\b\s*\**\s*([:=]?)\s*\**\s*[\[(]*\s*({_NUMBER})\s*[\])]*\s*(?:/\s*({_NUMBER}))?", re.IGNORECASE
)
_BARE_SCORE_RE = re.compile(rf"[\[(]*\s*({_NUMBER})\s*[\])]*\s*(?:/\s*({_NUMBER}))?\s*[.!]?")
_VERDICT_WORDS = {
    "yes": 1,
    "no": 0,
    "1": 1,
    "0": 0,
    "true": 1,
    "false": 0,
    "pass": 1,
    "fail": 0,
    "satisfied": 1,
    "not satisfied": 0,
    "unsatisfied": 0,
}
_VERDICT_ALT = "|".join(sorted((re.escape(w) for w in _VERDICT_WORDS), key=len, reverse=True))
_VERDICT_RE = re.compile(rf"\bverdict\b\s*\**\s*[:=]?\s*\**\s*[\[(]*\s*({_VERDICT_ALT})\b", re.IGNORECASE)
_BARE_VERDICT_RE = re.compile(rf"\**\s*({_VERDICT_ALT})\s*\**\s*[.!]?", re.IGNORECASE)


def final_answer(text: str) -> str:
    """The part of a judge reply that holds its verdict: after the last `</think>` of a reasoning
    model; a reply whose reasoning never closed has none."""
    if "</think>" in text:
        return text.rpartition("</think>")[2]
    if "<think>" in text:
        raise JudgeError("judge reply: reasoning (<think>) never closed")
    return text


def _short(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:60] + " ... " + text[-55:])


@dataclass(frozen=True)
class ScoreParser:
    """A score on the scale [lo, hi]: the last "Score: N" (or "Rating = N", "Score: N/hi", "Score:
    [[N]]") of the reply — the last "score N" without a colon only when there is none with one —
    or a reply that is only the number. A denominator other than `hi`, a number off the
    scale, or a fraction on an `integer` scale is an error, never a guess."""

    lo: float
    hi: float
    integer: bool = False

    def __call__(self, text: str) -> float:
        answer = final_answer(text).strip()
        if not answer:
            raise JudgeError("judge reply: empty")
        matches = list(_SCORE_RE.finditer(answer))
        marked = [m for m in matches if m.group(1)]  # "Score: N" outranks a "score N" in passing
        if matches:
            value, denom = (marked or matches)[-1].group(2, 3)
        else:
            bare = _BARE_SCORE_RE.fullmatch(answer)
            if bare is None:
                raise JudgeError(f"judge reply: no score in {_short(answer)}")
            value, denom = bare.group(1), bare.group(2)
        if denom is not None and float(denom) != self.hi:
            raise JudgeError(f"judge reply: score {value}/{denom} is not on the scale {self.lo:g}-{self.hi:g}")
        score = float(value)
        if self.integer and not score.is_integer():
            raise JudgeError(f"judge reply: score {value} is not an integer ({self.lo:g}-{self.hi:g})")
        if not self.lo <= score <= self.hi:
            raise JudgeError(f"judge reply: score {value} is off the scale {self.lo:g}-{self.hi:g}")
        return score

    def normalise(self, score: float) -> float:
        return (score - self.lo) / (self.hi - self.lo)


@dataclass(frozen=True)
class VerdictParser:
    """A 0/1 verdict: the last "Verdict: yes|no|1|0|true|false|pass|fail|satisfied|not satisfied"
    of the reply, or a reply that is only one of those words."""

    lo: float = 0.0
    hi: float = 1.0

    def __call__(self, text: str) -> float:
        answer = final_answer(text).strip()
        if not answer:
            raise JudgeError("judge reply: empty")
        matches = list(_VERDICT_RE.finditer(answer))
        word = matches[-1].group(1) if matches else None
        if word is None:
            bare = _BARE_VERDICT_RE.fullmatch(answer)
            if bare is None:
                raise JudgeError(f"judge reply: no verdict in {_short(answer)}")
            word = bare.group(1)
        return float(_VERDICT_WORDS[" ".join(word.lower().split())])

    def normalise(self, score: float) -> float:
        return score


Parser = ScoreParser | VerdictParser

# ---------------------------------------------------------------------------- templates

FIELDS = ("prompt", "response", "reference", "criterion")

_GENERIC = """You are grading a response to a task. Judge its correctness, completeness and clarity.

[Task]
{prompt}

[Response]
{response}

Reason briefly, then end with a line "Score: N", where N is an integer from 0 (worthless) to 10 (perfect)."""

_GENERIC_REFERENCE = """You are grading a response to a task against a reference answer. Judge whether \
the response reaches the same result as the reference and how well it argues for it.

[Task]
{prompt}

[Reference answer]
{reference}

[Response]
{response}

Reason briefly, then end with a line "Score: N", where N is an integer from 0 (wrong or worthless) \
to 10 (correct and complete)."""

# DR-Rubric: one atomic constraint per call, a binary verdict J_c(x) ∈ {0, 1}.
_RUBRIC_ITEM = """You check one constraint of a grading rubric against a response. Decide only \
whether the response satisfies this constraint; ignore everything else about it. A negative \
constraint ("does not ...") is satisfied when the response avoids what it names.

[Task]
{prompt}

[Response]
{response}

[Constraint]
{criterion}

End with a line "Verdict: yes" if the response satisfies the constraint, or "Verdict: no" if it does not."""

# ExpRL: verify against the step-level reference solution, do not solve; a 1-5 rubric score.
_EXPRL = """You are verifying a (possibly partial) solution to a problem against a reference \
solution. Do not solve the problem yourself: check each step of the attempt against the reference.

[Problem]
{prompt}

[Reference solution]
{reference}

[Attempt]
{response}

Rubric:
5 - correct: every step agrees with the reference and the final answer (if reached) is right;
4 - on track: the steps so far are correct, with at most a minor slip;
3 - partly right: some key steps are right, but there is a real error or a gap;
2 - mostly wrong: a wrong approach, with a few useful pieces;
1 - wrong or empty.

End with a line "Score: N", where N is an integer from 1 to 5."""


@dataclass(frozen=True)
class JudgeTemplate:
    """A judge prompt (str.format fields among `FIELDS`) and the parser of its replies."""

    prompt: str
    parser: Parser

    @property
    def fields(self) -> set[str]:
        return template_fields(self.prompt)


TEMPLATES: dict[str, JudgeTemplate] = {
    "score_0_10": JudgeTemplate(_GENERIC, ScoreParser(0, 10)),
    "score_0_10_reference": JudgeTemplate(_GENERIC_REFERENCE, ScoreParser(0, 10)),
    "rubric_item": JudgeTemplate(_RUBRIC_ITEM, VerdictParser()),
    "exprl": JudgeTemplate(_EXPRL, ScoreParser(1, 5, integer=True)),
}

# How the judge prompt is wrapped before it is sent as raw `text` (`/generate` applies no chat
# template): "none" sends it as is, "chatml" as one user turn of Qwen's chat format.
CHAT_FORMATS = {
    "none": "{}",
    "chatml": "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
}


def template_fields(prompt: str) -> set[str]:
    """The format fields of a prompt template; ValueError for a malformed one or an unknown field."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(prompt) if name is not None}
    except ValueError as err:
        raise ValueError(f"judge prompt template is malformed: {err}") from None
    unknown = names - set(FIELDS)
    if unknown:
        raise ValueError(
            f"judge prompt template has unknown fields {sorted(unknown)}; "
            f"allowed: {', '.join(FIELDS)} (write a literal brace as {{{{ or }}}})"
        )
    return names


def template(name: str, prompt: str | None = None) -> JudgeTemplate:
    """`TEMPLATES[name]`, with its prompt replaced by `prompt` if given (the parser stays)."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown judge template {name!r}; known: {', '.join(sorted(TEMPLATES))}")
    t = TEMPLATES[name]
    if prompt is not None:
        template_fields(prompt)
        t = JudgeTemplate(prompt, t.parser)
    return t


# Strings a judge's tokenizer may read as its own control tokens where they stand in plain text (Hugging
# Face tokenizers match added special tokens inside text): ChatML's, Llama 3's and Phi's `<|...|>`,
# DeepSeek's full-width `<｜...｜>`, SentencePiece's `<s>` / `</s>`, Mistral's `[INST]` / `[/INST]`.
_CONTROL = re.compile(r"<\||<｜|</?s>|\[/?INST\]")


def inert(text: str) -> str:
    """The policy's response as the judge reads it: every string that could be a control token of
    the judge's chat format broken by a zero-width space after its first character, so a response
    cannot close the judge's user turn and write the judge's own turn and verdict itself."""
    return _CONTROL.sub(lambda m: m.group(0)[0] + "\u200b" + m.group(0)[1:], text)


def render(t: JudgeTemplate, chat_format: str = "none", **values: str | None) -> str:
    """The judge prompt for one call; a field the template needs but the sample lacks is an error."""
    missing = sorted(f for f in t.fields if values.get(f) is None)
    if missing:
        raise JudgeError(f"judge template needs {', '.join(missing)}, which this sample does not have")
    return fill(t.prompt, chat_format, {f: str(values[f]) for f in t.fields})


def fill(prompt: str, chat_format: str, values: dict[str, str]) -> str:
    """A judge prompt template filled with `values` (the response made `inert`: it is the scored
    policy's text) and wrapped in the chat format — for every judge, generative ones too."""
    text = prompt.format(**{f: inert(v) if f == "response" else v for f, v in values.items()})
    return CHAT_FORMATS[chat_format].format(text)


# ---------------------------------------------------------------------------- the wire


_NEXT: dict[tuple[str, ...], int] = {}  # per group of judge servers: the index of the next one asked (this process)


BAD_VERDICT = ("lowest", "error")  # what a reply without a verdict scores (`JudgeServer.on_bad_verdict`)


class _Unreachable(Exception):
    """A judge server that cannot be reached (refused, reset): the call goes on to the next one."""


def _route_url(url: str, route: str = "/generate") -> str:
    """A server's route: `url` may be the server's address or its `/generate` itself."""
    base = url.rstrip("/")
    base = base[: -len("/generate")] if base.endswith("/generate") else base
    return base + route


@dataclass(frozen=True)
class JudgeServer:
    """Where the judge is and how to ask it (the options every judge reward takes). `url`: one
    server, or several (a judge group's, `judges[i]`): each call goes to the next one in turn, and on
    to the one after when a server cannot be reached (a dead engine costs no sample while another
    answers; a server that hangs still costs its samples at the timeout)."""

    url: str | Sequence[str]
    max_tokens: int = 512
    temperature: float = 0.0
    timeout: float = 25.0  # under the runner's default 30 s, so the judge's own message is the one seen
    api_key: str | None = None
    chat_format: str = "none"
    accept_truncated: bool = False  # a reply cut at max_tokens: trusted, or no verdict (default)
    sampling: dict | None = None  # more SGLang sampling_params (top_p, stop, ignore_eos, ...)
    on_bad_verdict: str = "lowest"  # a reply without a verdict: the scale's lowest score, or "error"

    def __post_init__(self) -> None:
        urls = [self.url] if isinstance(self.url, str) else self.url
        if not isinstance(urls, (list, tuple)) or not urls:
            raise ValueError(f"url: the judge server's http(s) address is required, got {self.url!r}")
        for u in urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"url: the judge server's http(s) address is required, got {u!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens: a positive integer is required, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout: must be > 0 seconds, got {self.timeout!r}")
        if self.sampling is not None:
            if not isinstance(self.sampling, dict) or not all(isinstance(k, str) for k in self.sampling):
                raise ValueError(f"sampling: a mapping of SGLang sampling_params is required, got {self.sampling!r}")
            taken = sorted({"max_new_tokens", "temperature"} & set(self.sampling))
            if taken:
                raise ValueError(f"sampling.{taken[0]}: set it with the judge's own option (max_tokens, temperature)")
        if self.on_bad_verdict not in BAD_VERDICT:
            raise ValueError(f"on_bad_verdict: {self.on_bad_verdict!r} is not one of {', '.join(BAD_VERDICT)}")
        if self.chat_format not in CHAT_FORMATS:
            raise ValueError(f"chat_format: {self.chat_format!r} is not one of {', '.join(CHAT_FORMATS)}")

    @property
    def urls(self) -> tuple[str, ...]:
        return (self.url,) if isinstance(self.url, str) else tuple(self.url)

    async def generate(self, prompts: Sequence[str]) -> list[str | None]:
        """The judge's reply to each prompt, in one `/generate` call (a batch when several), from the
        next server in turn; one that cannot be reached passes the call on to the one after. None: a
        reply cut at max_tokens (unless `accept_truncated`), which has no verdict."""
        body = {
            "text": list(prompts) if len(prompts) > 1 else prompts[0],
            "sampling_params": {
                **(self.sampling or {}),
                "max_new_tokens": self.max_tokens,
                "temperature": self.temperature,
            },
        }
        texts: list[str | None] = []
        for item in await self.request(body, len(prompts)):
            reason = ((item.get("meta_info") or {}).get("finish_reason") or {}).get("type")
            if reason == "abort":  # the server gave up on it: no answer, not a bad one
                raise JudgeError(f"judge reply stopped early (finish_reason {reason}): {_short(item['text'])}")
            texts.append(None if reason == "length" and not self.accept_truncated else item["text"])
        return texts

    async def request(self, body: dict[str, Any], n: int, route: str = "/generate") -> list[dict[str, Any]]:
        """The `n` results of one request `body` (SGLang's `/generate`, or another of its routes), from
        the next server in turn; one that cannot be reached passes the request on to the one after.
        `JudgeError` for no reply in time, an HTTP error (`JudgeRefused` for a 400: the request's own
        fault) or a reply that is not `n` results with a text."""
        urls = self.urls
        first = _NEXT.get(urls, 0) % len(urls)
        _NEXT[urls] = first + 1
        for k in range(len(urls)):
            try:
                return await self._post(_route_url(urls[(first + k) % len(urls)], route), body, n)
            except _Unreachable as err:
                if k == len(urls) - 1:
                    raise JudgeError(str(err)) from None
        raise AssertionError("unreachable")  # (the loop returns or raises)

    async def _post(self, url: str, body: dict[str, Any], n: int) -> list[dict[str, Any]]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                async with http.post(url, json=body, headers=headers) as resp:
                    raw = await resp.read()
                    status = resp.status
        except TimeoutError:
            raise JudgeError(f"judge {url}: no reply within {self.timeout:g}s") from None
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as err:
            raise _Unreachable(f"judge {url}: {type(err).__name__}: {err}") from None
        except aiohttp.ClientError as err:
            raise JudgeError(f"judge {url}: {type(err).__name__}: {err}") from None
        if status != 200:
            error = JudgeRefused if status == 400 else JudgeError
            raise error(f"judge {url}: HTTP {status}: {raw[:200].decode('utf-8', 'replace')}")
        try:
            out = json.loads(raw)
        except ValueError:
            raise JudgeError(f"judge {url}: the response is not JSON: {raw[:120]!r}") from None
        if url.endswith("/generate"):
            items = out if isinstance(out, list) else [out]
            if len(items) != n or not all(isinstance(i, dict) and isinstance(i.get("text"), str) for i in items):
                raise JudgeError(f"judge {url}: expected {n} generation(s) with a text, got {str(out)[:120]}")
            return items
        if not isinstance(out, dict):
            raise JudgeError(f"judge {url}: expected a JSON object, got {str(out)[:120]}")
        return [out]


async def _judge(
    server: JudgeServer, t: JudgeTemplate, values: Sequence[dict[str, str | None]]
) -> tuple[list[float], int]:
    """The parsed (raw-scale) score of each rendered prompt (one call, every reply parsed), and how
    many replies had no verdict (scored the scale's lowest; raised under `on_bad_verdict: error`)."""
    prompts = [render(t, server.chat_format, **v) for v in values]
    scores, unparsed = [], 0
    for text in await server.generate(prompts):
        try:
            if text is None:
                raise JudgeError("judge reply stopped early (finish_reason length): cut at max_tokens")
            scores.append(t.parser(text))
        except JudgeError:
            if server.on_bad_verdict == "error":
                raise
            scores.append(t.parser.lo)
            unparsed += 1
    return scores, unparsed


# ---------------------------------------------------------------------------- sample fields


def _from_label(sample: RewardInput, keys: Sequence[str]) -> Any:
    for source in (sample.metadata, sample.label if isinstance(sample.label, dict) else {}):
        for k in keys:
            if source.get(k) is not None:
                return source[k]
    return None


def reference_of(sample: RewardInput, reference: str | None = None) -> str | None:
    """The reference answer: the `reference` option, else the sample's metadata/label
    "reference" or "solution", else a label that is a plain string or number."""
    if reference is not None:
        return str(reference)
    found = _from_label(sample, ("reference", "solution"))
    if found is None and isinstance(sample.label, (str, int, float)) and not isinstance(sample.label, bool):
        found = sample.label
    return None if found is None else str(found)


def rubric_of(sample: RewardInput, rubric: Sequence[str] | None = None) -> list[str]:
    """The rubric constraints: the `rubric` option (one rubric for the whole domain), else the
    sample's metadata/label "rubric", else a label that is a list of strings."""
    items = rubric if rubric is not None else _from_label(sample, ("rubric",))
    if items is None and isinstance(sample.label, list):
        items = sample.label
    if not isinstance(items, (list, tuple)) or not items:
        raise JudgeError("rubric: the sample has no rubric (a non-empty list of constraints)")
    if not all(isinstance(c, str) and c.strip() for c in items):
        raise JudgeError("rubric: every constraint must be a non-empty string")
    return [c.strip() for c in items]


# ---------------------------------------------------------------------------- rewards


async def llm_judge_reward(
    sample: RewardInput,
    *,
    url: str,
    template: str = "score_0_10",
    prompt: str | None = None,
    reference: str | None = None,
    **server: Any,
) -> dict[str, Any]:
    """Generic LLM-as-judge: the judge's score on the template's scale, normalised to [0, 1].
    `prompt` replaces the template's text (same parser); a template with {reference} uses the
    sample's reference answer (`reference_of`)."""
    t = _template(template, prompt)
    values = {"prompt": sample.prompt, "response": sample.completion, "reference": reference_of(sample, reference)}
    (score,), unparsed = await _judge(JudgeServer(url, **server), t, [values])
    return {"reward": t.parser.normalise(score), "judge_score": score, "judge_unparsed": unparsed}


def rubric_mean(verdicts: Sequence[float]) -> float:
    """DR-Rubric: R(p, x) = (1/|R_p|) Σ_c J_c(x), the fraction of satisfied constraints."""
    if not verdicts:
        raise JudgeError("rubric: no verdicts")
    if any(v not in (0, 1) for v in verdicts):
        raise JudgeError(f"rubric: verdicts must be 0 or 1, got {list(verdicts)}")
    return sum(verdicts) / len(verdicts)


async def rubric_reward(
    sample: RewardInput,
    *,
    url: str,
    rubric: Sequence[str] | None = None,
    template: str = "rubric_item",
    prompt: str | None = None,
    **server: Any,
) -> dict[str, Any]:
    """DR-Rubric: a 0/1 verdict per constraint (all asked in one batched `/generate`), reward = the
    mean verdict. Any constraint without a verdict makes the whole sample an error."""
    t = _template(template, prompt)
    items = rubric_of(sample, rubric)
    values: list[dict[str, str | None]] = [
        {"prompt": sample.prompt, "response": sample.completion, "criterion": c} for c in items
    ]
    raw, unparsed = await _judge(JudgeServer(url, **server), t, values)
    verdicts = [t.parser.normalise(s) for s in raw]
    return {"reward": rubric_mean(verdicts), "verdicts": verdicts, "judge_unparsed": unparsed}


def polarization(rewards: Sequence[float], high: float = 0.99) -> float:
    """DR-Rubric's P_n: the fraction of samples whose rubric score is 0 or ≥ `high`."""
    if not rewards:
        return 0.0
    return sum(1 for r in rewards if r == 0 or r >= high) / len(rewards)


def polarization_stop(p_prev: float, p_now: float, floor: float = 0.15) -> bool:
    """DR-Rubric's bootstrap stop rule: stop when P_n > τ_n = max(floor, 2 P_{n-1})."""
    return p_now > max(floor, 2.0 * p_prev)


def exprl_normalise(score: float) -> float:
    """ExpRL: s = (s̃ - 1) / 4 for a judge score s̃ ∈ {1..5}."""
    return TEMPLATES["exprl"].parser.normalise(score)


async def exprl_reward(
    sample: RewardInput,
    *,
    url: str,
    reference: str | None = None,
    template: str = "exprl",
    prompt: str | None = None,
    **server: Any,
) -> dict[str, Any]:
    """ExpRL-Outcome: the judge scores the whole response against the reference solution (1–5),
    reward s = (s̃ - 1) / 4 ∈ {0, .25, .5, .75, 1}. A sample without a reference is an error (the
    notes: without the matched reference the judge misplaces far more)."""
    t = _template(template, prompt)
    values = {"prompt": sample.prompt, "response": sample.completion, "reference": reference_of(sample, reference)}
    (score,), unparsed = await _judge(JudgeServer(url, **server), t, [values])
    return {"reward": t.parser.normalise(score), "judge_score": score, "judge_unparsed": unparsed}


def segment_ends(text: str, delimiter: str = "###") -> list[int]:
    """ExpRL-Process: the end (character offset, exclusive) of each segment of `text` split at
    `delimiter`; the delimiter belongs to the segment it closes, empty segments are dropped, and
    the last segment always ends at len(text)."""
    if not delimiter:
        raise ValueError("delimiter: must be a non-empty string")
    ends, start = [], 0
    while True:
        at = text.find(delimiter, start)
        if at < 0:
            break
        end = at + len(delimiter)
        if text[start:at].strip():
            ends.append(end)
        start = end
    if text[start:].strip() or not ends:
        ends.append(len(text))
    else:
        ends[-1] = len(text)
    return ends


def delta_advantages(scores: Sequence[float], norm: str = "delta") -> list[float]:
    """ExpRL-Process segment advantages from the prefix scores s_1..s_T (no group normalisation):
    "delta" (DeltaNorm): A_1 = s_1 - s_T, A_t = s_t - s_{t-1}; "end" (EndNorm): A_t = s_t - s_T."""
    if not scores:
        raise ValueError("scores: at least one segment score is needed")
    last = scores[-1]
    if norm == "delta":
        return [scores[0] - last] + [scores[t] - scores[t - 1] for t in range(1, len(scores))]
    if norm == "end":
        return [s - last for s in scores]
    raise ValueError(f"norm: {norm!r} is not one of delta, end")


def token_advantages(advantages: Sequence[float], ends: Sequence[int], token_ends: Sequence[int]) -> list[float]:
    """Every token gets the advantage of the segment it ends in: `ends` are the segments' end
    offsets (`segment_ends`), `token_ends` each response token's end offset in the same text."""
    if len(advantages) != len(ends):
        raise ValueError(f"{len(advantages)} advantages for {len(ends)} segments")
    out, seg = [], 0
    for end in token_ends:
        while seg < len(ends) - 1 and end > ends[seg]:
            seg += 1
        out.append(float(advantages[seg]))
    return out


async def exprl_process_reward(
    sample: RewardInput,
    *,
    url: str,
    reference: str | None = None,
    delimiter: str = "###",
    norm: str = "delta",
    template: str = "exprl",
    prompt: str | None = None,
    **server: Any,
) -> dict[str, Any]:
    """ExpRL-Process: judge every prefix y_≤t that ends a segment (one batched call of T prompts);
    reward = s_T (the full response's score), info: the prefix scores, the segment ends and the
    segment advantages (`delta_advantages`) that a process-level learner spreads over the tokens."""
    t = _template(template, prompt)
    ref = reference_of(sample, reference)
    ends = segment_ends(sample.completion, delimiter)
    values = [{"prompt": sample.prompt, "response": sample.completion[:e], "reference": ref} for e in ends]
    raw, unparsed = await _judge(JudgeServer(url, **server), t, values)
    scores = [t.parser.normalise(s) for s in raw]
    return {
        "reward": scores[-1],
        "judge_unparsed": unparsed,
        "segment_scores": scores,
        "segment_ends": ends,
        "segment_advantages": delta_advantages(scores, norm),
    }


# ---------------------------------------------------------------------------- binding options


def _template(name: str, prompt: str | None) -> JudgeTemplate:
    try:
        return template(name, prompt)
    except ValueError as err:
        raise JudgeError(str(err)) from None


JUDGE_REWARDS: dict[str, Callable[..., Any]] = {
    "llm_judge": llm_judge_reward,
    "rubric": rubric_reward,
    "exprl_judge": exprl_reward,
    "exprl_process": exprl_process_reward,
}
_SERVER_OPTIONS = {f.name for f in dataclasses.fields(JudgeServer)}


def _own_options(fn: Callable[..., Any]) -> dict[str, Any]:
    """A judge reward's own keyword options and their defaults (the rest go to `JudgeServer`)."""
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name != "url"
    }


def check_options(name: str, options: dict[str, Any]) -> None:
    """ValueError naming the option for anything a judge reward would refuse on every sample: an
    unknown option, no url, a bad server setting, an unknown template, a malformed prompt."""
    if name not in JUDGE_REWARDS:
        raise ValueError(f"unknown judge reward {name!r}; known: {', '.join(JUDGE_REWARDS)}")
    own = {**_own_options(JUDGE_REWARDS[name]), **{k: v for k, v in options.items() if k not in _SERVER_OPTIONS}}
    unknown = set(own) - set(_own_options(JUDGE_REWARDS[name]))
    if unknown:
        known = set(_own_options(JUDGE_REWARDS[name])) | _SERVER_OPTIONS
        raise ValueError(
            f"{sorted(unknown)[0]}: not an option of the {name!r} reward; options: {', '.join(sorted(known))}"
        )
    url: Any = options.get("url")  # as the user wrote it (JudgeServer checks it, None included)
    JudgeServer(**{k: v for k, v in options.items() if k in _SERVER_OPTIONS and k != "url"}, url=url)
    template(own["template"], own["prompt"])
    if name == "exprl_process":
        delta_advantages([0.0], own["norm"])
        segment_ends("", own["delimiter"])


def judge_reward_fn(
    name: str, *, timeout_s: float | None = None, error_reward: float = 0.0, **options: Any
) -> RewardFunction:
    """The judge reward `name` with its options bound, checked first (`check_options`), as a
    `RewardFunction` for the runner. Its timeout (default: the HTTP timeout + 5 s) bounds the
    whole call, so a judge that hangs costs its sample at most that long."""
    check_options(name, options)
    fn = functools.partial(JUDGE_REWARDS[name], **options)
    if timeout_s is None:
        timeout_s = float(options.get("timeout", JudgeServer.timeout)) + 5.0
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
    return RewardFunction(fn, timeout_s=timeout_s, error_reward=error_reward, name=name)


__all__ = [
    "CHAT_FORMATS",
    "FIELDS",
    "JUDGE_REWARDS",
    "JudgeError",
    "JudgeServer",
    "JudgeTemplate",
    "ScoreParser",
    "TEMPLATES",
    "VerdictParser",
    "check_options",
    "delta_advantages",
    "exprl_normalise",
    "exprl_process_reward",
    "exprl_reward",
    "final_answer",
    "judge_reward_fn",
    "llm_judge_reward",
    "polarization",
    "polarization_stop",
    "reference_of",
    "render",
    "rubric_mean",
    "rubric_of",
    "rubric_reward",
    "segment_ends",
    "template",
    "template_fields",
    "token_advantages",
]
