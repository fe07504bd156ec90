"""Z-Reward's generative teacher: a causal LM asked to judge, read as a distribution over scores.

"Beyond Scalar Rewards by Internalizing Reasoning into Score Distributions" (Z-Reward) decodes a
generative reward model Q-Align style: the judge's probabilities of the score tokens at the score
position, renormalised over them, are q(s); the reward is the expected score μ = Σ_s v_s·q(s)
(`algos/z_reward.py`), dense where a parsed text score would be quantised. Here the judge is any
server that speaks SGLang's `/generate` (`sglang.launch_server`, `mcore-rl serve`, a judge group
`judges:` the trainer starts), asked with text in SGLang's own fields:

    POST /generate {"text": [judge prompt, ...], "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                    "return_logprob": true, "token_ids_logprob": [the score tokens' ids]}

and `meta_info.output_token_ids_logprobs[0]` holds `[logprob, id, text]` of every score token at
the first generated position: the judge's next-token log-probs after the prompt. Temperature 1, so
the log-probs are the model's own whichever way a server applies temperature to the ones it
returns; the one sampled token is thrown away. The prompt is the template (fields `prompt`,
`response`, `rubric`, `reference`) in the chat format, then the `cue` ("Score (0-9): "). With
`reasoning_tokens` > 0 the judge first reasons, as the paper's teacher does: one `/generate` of up to
that many tokens (`reasoning_temperature`, greedy by default) stopped where it writes the cue, then
the scoring request on the prompt, its reasoning and the cue.

The score tokens (`score_tokens`, default "0".."9", worth `score_values`, default 0..9) must each
be one token of the judge's tokenizer: their ids come from the server's `/tokenize` (SGLang serves
it for every model) on first use; a string of several tokens is refused with a message naming
`score_tokens` (and the trainer probes every such head before training). The calls of one event-loop
iteration (a group's samples, a round's groups) are one batched request (`ScoreBatcher`, up to
`max_batch`); a server that does not answer within `timeout`, or dies, costs the samples of that
batch (reward errors). A batch the server refuses as bad (400: a response too long for the
judge's context) is sent again row by row, and a row it still refuses scores `refused_score`, else
the lowest score value (the policy's doing: as an error it would escape its score), `refused` in
its info.

`generative_rm_score` is the reward head (registered as "generative_rm"); `GenerativeJudge` is the
same teacher for `tools/label_score_distributions.py`, which writes q for `rm-train`'s
`score_distribution` objective (the student).
"""

from __future__ import annotations

import asyncio
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.algos.z_reward import expected_score
from mcore_rl.rewards.base import RewardInput
from mcore_rl.rewards.judge import (
    CHAT_FORMATS,
    JudgeError,
    JudgeRefused,
    JudgeServer,
    fill,
    reference_of,
)
from mcore_rl.rewards.reward_model import BadRows, Refused, RewardModelError, ScoreBatcher, worst_score

FIELDS = ("prompt", "response", "rubric", "reference")

TEMPLATE = """You are grading a response to a task. {rubric}

[Task]
{prompt}

[Response]
{response}

Give one digit from 0 (worthless) to 9 (perfect).
"""
RUBRIC = "Judge its correctness, completeness and clarity."
CUE = "Score (0-9): "
SCORE_TOKENS = tuple(str(d) for d in range(10))


class GenerativeRMError(RewardModelError):
    """An option or a judge the generative reward model cannot use; the message names the option."""


def template_fields(template: str) -> set[str]:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise GenerativeRMError(f"template: malformed: {err}") from None
    unknown = names - set(FIELDS)
    if unknown:
        raise GenerativeRMError(
            f"template: unknown fields {sorted(unknown)}; allowed: {', '.join(FIELDS)} (a literal brace is {{{{ or }}}})"
        )
    if not {"prompt", "response"} <= names:
        raise GenerativeRMError("template: must hold {prompt} and {response}")
    return names


@dataclass(frozen=True)
class JudgeSpec:
    """The options of a generative judge, checked (`check`) before any worker starts."""

    template: str = TEMPLATE
    rubric: str = RUBRIC
    cue: str = CUE
    score_tokens: tuple[str, ...] = SCORE_TOKENS
    score_values: tuple[float, ...] | None = None  # None: 0, 1, ..., len(score_tokens) - 1
    chat_format: str = "none"
    reasoning_tokens: int = 0  # > 0: the judge first writes up to this many tokens, stopped at the cue
    reasoning_temperature: float = 0.0

    @property
    def values(self) -> tuple[float, ...]:
        return (
            self.score_values
            if self.score_values is not None
            else tuple(float(i) for i in range(len(self.score_tokens)))
        )

    def check(self) -> None:
        """GenerativeRMError whose message starts with the option at fault."""
        if not isinstance(self.template, str):
            raise GenerativeRMError(f"template: a string is required, got {self.template!r}")
        template_fields(self.template)
        if not isinstance(self.rubric, str):
            raise GenerativeRMError(f"rubric: a string is required, got {self.rubric!r}")
        if not isinstance(self.cue, str) or not self.cue.strip():
            raise GenerativeRMError(f"cue: a non-empty string (what precedes the score) is required, got {self.cue!r}")
        tokens = self.score_tokens
        if (
            not isinstance(tokens, (list, tuple))
            or len(tokens) < 2
            or not all(isinstance(t, str) and t for t in tokens)
        ):
            raise GenerativeRMError(f"score_tokens: a list of at least 2 non-empty strings is required, got {tokens!r}")
        if len(set(tokens)) != len(tokens):
            raise GenerativeRMError(f"score_tokens: each score token must be listed once, got {list(tokens)}")
        if self.score_values is not None:
            v = self.score_values
            if (
                not isinstance(v, (list, tuple))
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
                or len(v) != len(tokens)
            ):
                raise GenerativeRMError(
                    f"score_values: {len(tokens)} finite numbers (one per score token) are required, got {v!r}"
                )
        if self.chat_format not in CHAT_FORMATS:
            raise GenerativeRMError(f"chat_format: {self.chat_format!r} is not one of {', '.join(CHAT_FORMATS)}")
        r = self.reasoning_tokens
        if not (isinstance(r, int) and not isinstance(r, bool) and r >= 0):
            raise GenerativeRMError(f"reasoning_tokens: an integer >= 0 is required, got {r!r}")
        t = self.reasoning_temperature
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0):
            raise GenerativeRMError(f"reasoning_temperature: a number >= 0 is required, got {t!r}")

    def render(self, prompt: str, response: str, reference: str | None = None) -> str:
        """The judge's prompt for one (prompt, response): the template in the chat format (the
        response made inert, as for every LLM judge: `judge.render`), then the cue."""
        fields = template_fields(self.template)
        if "reference" in fields and reference is None:
            raise GenerativeRMError("template: needs {reference}, which this sample does not have")
        values = {"prompt": prompt, "response": response, "rubric": self.rubric, "reference": reference}
        return fill(self.template, self.chat_format, {f: str(values[f]) for f in fields}) + self.cue


def scoring_body(prompts: Sequence[str], score_ids: Sequence[int]) -> dict[str, Any]:
    """SGLang's `/generate` body that returns the score tokens' log-probs after each prompt."""
    return {
        "text": list(prompts) if len(prompts) > 1 else prompts[0],
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "token_ids_logprob": [int(i) for i in score_ids],
    }


def parse_score_logprobs(item: dict[str, Any], score_ids: Sequence[int], where: str) -> torch.Tensor:
    """The score tokens' log-probs [S] (in `score_ids` order) at the first generated position of one
    `/generate` result; GenerativeRMError when the reply does not hold them."""
    meta = item.get("meta_info") or {}
    rows = meta.get("output_token_ids_logprobs")
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], list):
        raise GenerativeRMError(f"{where}: no output_token_ids_logprobs in the reply: {str(meta)[:160]}")
    by_id: dict[int, float] = {}
    for e in rows[0]:
        if isinstance(e, (list, tuple)) and len(e) >= 2 and isinstance(e[0], (int, float)) and isinstance(e[1], int):
            by_id[e[1]] = float(e[0])
    missing = [i for i in score_ids if i not in by_id]
    if missing:
        raise GenerativeRMError(f"{where}: the reply has no log-prob of the score token ids {missing[:8]}")
    return torch.tensor([by_id[i] for i in score_ids], dtype=torch.float64)


def distribution(score_logprobs: torch.Tensor) -> torch.Tensor:
    """q [.., S]: the score tokens' log-probs renormalised over the score tokens."""
    return torch.softmax(score_logprobs.double(), -1)


@dataclass
class GenerativeJudge:
    """One judge server group (`server`) asked with `spec`: `score_ids` from the server's `/tokenize`
    (once), `distributions(prompts)` q [N, S] for rendered prompts in one request."""

    server: JudgeServer
    spec: JudgeSpec
    max_batch: int = 64
    score_ids: list[int] | None = None
    batcher: ScoreBatcher = field(init=False)

    def __post_init__(self) -> None:
        self.batcher = ScoreBatcher(self._forward, self.max_batch)

    async def resolve_score_ids(self) -> list[int]:
        """The score tokens' ids in the judge's tokenizer (SGLang's `/tokenize`); a score token of
        several tokens is a GenerativeRMError naming `score_tokens`."""
        if self.score_ids is None:
            body = {"prompt": list(self.spec.score_tokens), "add_special_tokens": False}
            try:
                (reply,) = await self.server.request(body, 1, route="/tokenize")
            except JudgeError as err:
                raise GenerativeRMError(f"the judge's /tokenize: {err}"[:300]) from None
            self.score_ids = single_token_ids(self.spec.score_tokens, reply.get("tokens"), self.server.urls[0])
        return self.score_ids

    async def distributions(self, prompts: Sequence[str]) -> torch.Tensor:
        """q [N, S] of rendered prompts, as one `/generate` request."""
        return torch.stack(list(await self._forward(list(prompts))))

    async def _forward(self, prompts: list[Any]) -> list[torch.Tensor]:
        ids = await self.resolve_score_ids()
        try:
            if self.spec.reasoning_tokens > 0:
                prompts = await self.reason(prompts)
            items = await self.server.request(scoring_body(prompts, ids), len(prompts))
        except JudgeRefused as err:
            raise BadRows(str(err)[:300]) from None
        except JudgeError as err:
            raise GenerativeRMError(str(err)[:300]) from None
        return [distribution(parse_score_logprobs(it, ids, self.server.urls[0])) for it in items]

    async def reason(self, prompts: Sequence[str]) -> list[str]:
        """The scored prompts of a judge that reasons first: each rendered prompt without its cue,
        the judge's reply to it (up to `reasoning_tokens`, stopped where it writes the cue itself,
        which SGLang trims), then the cue."""
        cue = self.spec.cue
        heads = [p[: len(p) - len(cue)] for p in prompts]
        body = {
            "text": heads if len(heads) > 1 else heads[0],
            "sampling_params": {
                "max_new_tokens": self.spec.reasoning_tokens,
                "temperature": float(self.spec.reasoning_temperature),
                "stop": [cue.strip()],
            },
        }
        items = await self.server.request(body, len(heads))
        return [h + it["text"] + cue for h, it in zip(heads, items)]

    async def score(self, prompt: str) -> torch.Tensor:
        """q [S] of one rendered prompt, batched with the calls of the same loop iteration."""
        return await self.batcher.score(prompt)


def single_token_ids(tokens: Sequence[str], reply: Any, where: str) -> list[int]:
    """Each score token's one id from `/tokenize`'s `tokens` (a list of id lists); GenerativeRMError
    naming `score_tokens` for a score of several tokens (or none)."""
    if not isinstance(reply, list) or len(reply) != len(tokens) or not all(isinstance(r, list) for r in reply):
        raise GenerativeRMError(
            f"the judge's /tokenize at {where} did not answer one id list per score token: {reply!r}"[:300]
        )
    for tok, ids in zip(tokens, reply):
        if len(ids) != 1:
            raise GenerativeRMError(
                f"score_tokens: {tok!r} is {len(ids)} tokens {ids} of the judge's tokenizer at {where}; "
                "every score must be one token"
            )
    out = [int(r[0]) for r in reply]
    if len(set(out)) != len(out):
        raise GenerativeRMError(f"score_tokens: {list(tokens)} map to repeated ids {out} of the judge's tokenizer")
    return out


_JUDGES: dict[tuple, GenerativeJudge] = {}


def judge_for(
    url: str | Sequence[str], spec: JudgeSpec, max_batch: int, timeout: float, api_key: str | None
) -> GenerativeJudge:
    """This process's judge of those servers and options (one batcher, score ids resolved once)."""
    urls = (url,) if isinstance(url, str) else tuple(url)
    key = (urls, spec, max_batch, timeout, api_key)
    if key not in _JUDGES:
        server = JudgeServer(list(urls) if len(urls) > 1 else urls[0], timeout=timeout, api_key=api_key)
        _JUDGES[key] = GenerativeJudge(server, spec, max_batch)
    return _JUDGES[key]


def spec_of(options: dict[str, Any]) -> JudgeSpec:
    """The `JudgeSpec` of a head's options (lists made tuples), unchecked."""
    names = ("template", "rubric", "cue", "chat_format", "reasoning_tokens", "reasoning_temperature")
    kw: dict[str, Any] = {k: options[k] for k in names if k in options}
    for k in ("score_tokens", "score_values"):
        if isinstance(options.get(k), list):
            kw[k] = tuple(options[k])
        elif k in options:
            kw[k] = options[k]
    return JudgeSpec(**kw)


OPTIONS = {
    "url", "template", "rubric", "cue", "score_tokens", "score_values", "chat_format", "max_batch",
    "timeout", "api_key", "refused_score", "reference", "reasoning_tokens", "reasoning_temperature",
}  # fmt: skip


def check_options(options: dict[str, Any]) -> None:
    """GenerativeRMError, its message starting with the option at fault, for anything that would fail
    on every sample (the score tokens' single-token check needs the judge: `check_score_tokens`)."""
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise GenerativeRMError(
            f"{unknown[0]}: not an option of 'generative_rm'; options: {', '.join(sorted(OPTIONS))}"
        )
    url = options.get("url")
    urls = [url] if isinstance(url, str) else url
    if (
        not isinstance(urls, list)
        or not urls
        or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls)
    ):
        raise GenerativeRMError(
            f"url: the judge server's http(s) address (or a `judge` group) is required, got {url!r}"
        )
    spec_of(options).check()
    mb = options.get("max_batch", 64)
    if not (isinstance(mb, int) and not isinstance(mb, bool) and mb >= 1):
        raise GenerativeRMError(f"max_batch: a positive integer is required, got {mb!r}")
    t = options.get("timeout", 25.0)
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0):
        raise GenerativeRMError(f"timeout: must be > 0 seconds, got {t!r}")
    r = options.get("refused_score")
    if r is not None and not (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)):
        raise GenerativeRMError(f"refused_score: must be a finite number, got {r!r}")


def check_score_tokens(url: str | Sequence[str], score_tokens: Sequence[str], api_key: str | None = None) -> list[int]:
    """Before training: the score tokens' ids in the judge's tokenizer, each one token (else
    GenerativeRMError naming `score_tokens`); the judge's `/tokenize` must answer."""
    judge = GenerativeJudge(JudgeServer(url, api_key=api_key), JudgeSpec(score_tokens=tuple(score_tokens)))
    return asyncio.run(judge.resolve_score_ids())


async def generative_rm_score(
    sample: RewardInput,
    *,
    url: str | list[str],
    template: str = TEMPLATE,
    rubric: str = RUBRIC,
    cue: str = CUE,
    score_tokens: Sequence[str] = SCORE_TOKENS,
    score_values: Sequence[float] | None = None,
    chat_format: str = "none",
    max_batch: int = 64,
    timeout: float = 25.0,
    api_key: str | None = None,
    refused_score: float | None = None,
    reference: str | None = None,
    reasoning_tokens: int = 0,
    reasoning_temperature: float = 0.0,
) -> dict[str, Any]:
    """The judge's expected score μ = Σ_s v_s·q(s) of one sample (`reward`), with q
    (`score_distribution`) in its info; see the module docstring."""
    spec = spec_of(
        {
            "template": template,
            "rubric": rubric,
            "cue": cue,
            "score_tokens": list(score_tokens),
            "score_values": None if score_values is None else list(score_values),
            "chat_format": chat_format,
            "reasoning_tokens": reasoning_tokens,
            "reasoning_temperature": reasoning_temperature,
        }
    )
    spec.check()
    judge = judge_for(url, spec, max_batch, timeout, api_key)
    text = spec.render(sample.prompt, sample.completion, reference_of(sample, reference))
    try:
        q = await judge.score(text)
    except Refused as err:
        return {"reward": worst_score(refused_score, list(spec.values), None, str(err)), "refused": str(err)[:300]}
    mu = float(expected_score(q, torch.tensor(spec.values, dtype=torch.float64)))
    return {"reward": mu, "score_distribution": [float(x) for x in q]}


__all__ = [
    "CUE",
    "FIELDS",
    "GenerativeJudge",
    "GenerativeRMError",
    "JudgeSpec",
    "RUBRIC",
    "SCORE_TOKENS",
    "TEMPLATE",
    "check_options",
    "check_score_tokens",
    "distribution",
    "generative_rm_score",
    "judge_for",
    "parse_score_logprobs",
    "scoring_body",
    "single_token_ids",
    "spec_of",
]
