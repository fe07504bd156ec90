"""Engine teachers of on-policy distillation: another engine scores the student's sampled tokens.

A teacher engine is any SGLang-compatible server (`sglang.launch_server`, or `mcore-rl serve`
started by the trainer on a checkpoint, `start_teacher_engines`). It scores a sample with
SGLang's prompt-scoring request, nothing generated:

    POST /generate {"input_ids": prompt + response, "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": true, "logprob_start_len": len(prompt) - 1,
                    "top_logprobs_num": k}

SGLang returns `meta_info.input_token_logprobs` aligned with `input_ids[logprob_start_len:]`,
the first entry always `[null, id, ...]` (the scheduler pads it: the log-prob of the token at
`logprob_start_len` would need the position before it). Starting at the last prompt token
therefore gives exactly one entry per response token after that padding: entry j + 1 is
log p_teacher(response[j] | prompt, response[:j]), and `input_top_logprobs[j + 1]` the teacher's
k best tokens at that position. (Starting at `len(prompt)` would lose the first response token.)

Failures cost requests, never the run: the teacher's `EngineRouter` sends a request that an
engine could not answer to another engine of the same teacher (same rid, aborted first), and a
sample whose request no engine could answer, that the engine refused (HTTP 4xx, e.g. longer than
its context), or whose reply does not fit the sample is marked `TeacherScores.error` and gets no
distillation term. A dead engine serves again once its `/health` answers (a started one is
restarted on the same checkpoint by the pool).

A teacher may have a *reference* (`EngineTeacher.reference`: another engine teacher serving its
starting point π_Tref, for Direct-OPD). For every sample the teacher scored, the reference scores
the same tokens and, with SGLang's `token_ids_logprob` = the union of the teacher's top-k ids of the
sample, the log-probs of those ids at every response position, from which `ref_topk_logp[j]` is
taken at exactly the teacher's `topk_ids[j]` (`reference_body`, `parse_reference`). The reply holds
|union| values per position (at most k · len(response)). A reference that cannot score the sample
marks it like the teacher's own failure does.

Before training, `EngineTeacher.check` refuses a teacher that does not answer or whose tokenizer
is not the student's (`check_tokenizer`); `route_by_domain` gives each sample at most one teacher
(UI-MOPD: routed by the sample's domain tag, teachers never mixed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any
from collections.abc import Collection, Sequence

from mcore_rl.data.samples import Sample, TeacherScores
from mcore_rl.data.tokenizer_match import probe_ids, probe_texts, short_ids
from mcore_rl.rollout.engine_processes import EngineProcesses

logger = logging.getLogger(__name__)


class TeacherError(RuntimeError):
    """A teacher that cannot be used: unreachable, another tokenizer, a bad setting. Raised before
    training; the message names the teacher (`teachers[i]`) and the engine."""


def route_by_domain(
    teacher_domains: Sequence[Sequence[str]], domains: Sequence[str], skip: Collection[int] = ()
) -> list[int | None]:
    """The teacher of each sample: the one whose `domains` list the sample's domain, else the one
    with no `domains` (the default), else None (no teacher: no distillation term). Teachers in
    `skip` (references) are never routed to. The config guarantees that no domain is claimed twice
    and that there is at most one default."""
    by_domain = {d: i for i, ds in enumerate(teacher_domains) if i not in skip for d in ds}
    default = next((i for i, ds in enumerate(teacher_domains) if not ds and i not in skip), None)
    return [by_domain.get(d, default) for d in domains]


def scoring_body(prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int, rid: str) -> dict[str, Any]:
    """SGLang's prompt-scoring `/generate` body for one sample (see the module docstring)."""
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": [int(t) for t in prompt_ids] + [int(t) for t in response_ids],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": len(prompt_ids) - 1,
    }
    if top_k > 0:
        body["top_logprobs_num"] = top_k
    return body


def parse_scores(reply: Any, response_ids: Sequence[int], top_k: int, vocab_size: int, source: str) -> TeacherScores:
    """`TeacherScores` from a prompt-scoring reply; ValueError (naming what is wrong) when the reply
    does not score exactly `response_ids`."""
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
        raise ValueError(f"reply is not a /generate result: {str(reply)[:200]}")
    meta = reply["meta_info"]
    entries = meta.get("input_token_logprobs")
    n = len(response_ids)
    if not isinstance(entries, list) or len(entries) != n + 1:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ValueError(
            f"input_token_logprobs: expected {n + 1} entries (last prompt token + {n} response tokens), got {got}"
        )
    logp: list[float] = []
    for j, (entry, tok) in enumerate(zip(entries[1:], response_ids)):
        if not (isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[0], (int, float)) and entry[1] == tok):
            raise ValueError(f"input_token_logprobs[{j + 1}]: expected [logprob, {tok}, ...], got {str(entry)[:80]}")
        logp.append(float(entry[0]))
    if top_k <= 0:
        return TeacherScores(logp=logp, source=source)
    tops = meta.get("input_top_logprobs")
    if not isinstance(tops, list) or len(tops) != n + 1:
        raise ValueError(
            f"input_top_logprobs: expected {n + 1} entries, got "
            f"{len(tops) if isinstance(tops, list) else type(tops).__name__}"
        )
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for j, pos in enumerate(tops[1:]):
        if not isinstance(pos, list) or len(pos) != top_k:
            raise ValueError(f"input_top_logprobs[{j + 1}]: expected {top_k} entries, got {str(pos)[:80]}")
        row_ids = [e[1] for e in pos if isinstance(e, list) and len(e) >= 2]
        row_lp = [e[0] for e in pos if isinstance(e, list) and len(e) >= 2]
        if (
            len(row_ids) != top_k
            or not all(isinstance(t, int) and 0 <= t < vocab_size for t in row_ids)
            or not all(isinstance(v, (int, float)) for v in row_lp)
        ):
            raise ValueError(
                f"input_top_logprobs[{j + 1}]: expected [logprob, id < {vocab_size}] pairs, got {str(pos)[:80]}"
            )
        ids.append(row_ids)
        lps.append([float(v) for v in row_lp])
    return TeacherScores(logp=logp, topk_ids=ids, topk_logp=lps, source=source)


def reference_body(
    prompt_ids: Sequence[int], response_ids: Sequence[int], topk_ids: Sequence[Sequence[int]] | None, rid: str
) -> tuple[dict[str, Any], list[int] | None]:
    """The reference's scoring body: the teacher's (no top-k) plus `token_ids_logprob` = the sorted
    union of the teacher's top-k ids of the sample (when it gave any); and that id list."""
    body = scoring_body(prompt_ids, response_ids, 0, rid)
    ids = sorted({int(t) for row in topk_ids for t in row}) if topk_ids else None
    if ids:
        body["token_ids_logprob"] = ids
    return body, ids


def parse_reference(
    reply: Any,
    response_ids: Sequence[int],
    topk_ids: Sequence[Sequence[int]] | None,
    ids: Sequence[int] | None,
    vocab_size: int,
) -> tuple[list[float], list[list[float]] | None]:
    """(ref_logp, ref_topk_logp) from the reference's reply: the log-probs of the sampled tokens,
    and at every position j those of exactly `topk_ids[j]` (None without top-k); ValueError when
    the reply does not score `response_ids` at `ids`."""
    logp = parse_scores(reply, response_ids, 0, vocab_size, "").logp
    if not ids:
        return logp, None
    if topk_ids is None:
        raise ValueError("reference scores at the teacher's top-k ids need those ids (topk_ids)")
    entries = reply["meta_info"].get("input_token_ids_logprobs")
    n = len(response_ids)
    if not isinstance(entries, list) or len(entries) != n + 1:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ValueError(f"input_token_ids_logprobs: expected {n + 1} entries, got {got}")
    out: list[list[float]] = []
    for j, (pos, want) in enumerate(zip(entries[1:], topk_ids)):
        if not isinstance(pos, list) or len(pos) != len(ids):
            raise ValueError(f"input_token_ids_logprobs[{j + 1}]: expected {len(ids)} entries, got {str(pos)[:80]}")
        by_id: dict[int, float] = {}
        for e in pos:
            if not (isinstance(e, list) and len(e) >= 2 and isinstance(e[0], (int, float)) and isinstance(e[1], int)):
                raise ValueError(
                    f"input_token_ids_logprobs[{j + 1}]: expected [logprob, id] entries, got {str(e)[:80]}"
                )
            by_id[e[1]] = float(e[0])
        missing = [t for t in want if t not in by_id]
        if missing:
            raise ValueError(f"input_token_ids_logprobs[{j + 1}]: no log-prob of the teacher's top-k ids {missing[:8]}")
        out.append([by_id[t] for t in want])
    return logp, out


class EngineTeacher:
    """One teacher served by one or more engines (`urls`), reached through its own `HTTPEnginePool`
    (router with failover, health checks; with `processes`, the engine processes it owns and
    restarts). Scoring never raises: a sample it cannot score is marked."""

    def __init__(
        self,
        name: str,
        urls: Sequence[str],
        *,
        vocab_size: int,
        top_k: int = 0,
        timeout: float = 600.0,
        api_key: str | None = None,
        max_concurrency: int = 64,
        health_interval: float = 5.0,
        processes: EngineProcesses | None = None,
        restart_dead: bool = True,
    ) -> None:
        from mcore_rl.rollout.pool import HTTPEnginePool  # lazy: torch

        self.name, self.top_k, self.vocab_size = name, top_k, vocab_size
        self.pool = HTTPEnginePool(
            urls,
            timeout=timeout,
            api_key=api_key,
            health_interval=health_interval,
            processes=processes,
            restart_dead=restart_dead and processes is not None,
        )
        self.urls = self.pool.urls
        self._sem: asyncio.Semaphore | None = None
        self.max_concurrency = max_concurrency
        self._count = 0
        self.reference: EngineTeacher | None = None  # π_Tref: scores what this teacher scored (Direct-OPD)

    # ---- before training ---------------------------------------------------------------------

    def check(self, tokenizer: Any, what: str) -> None:
        """Every engine answers and has the student's tokenizer; else `TeacherError` naming `what`
        (e.g. "teachers[0] (math)") and the engine."""
        check_engines(self.pool, self.urls, tokenizer, f"{what}: the teacher engine", "the student's", TeacherError)

    # ---- scoring -----------------------------------------------------------------------------

    def score(self, samples: Sequence[Sample]) -> None:
        """Fill `sample.teacher` of every sample (blocking; from the trainer thread)."""
        self.pool._run(self._score_all(samples))

    async def ascore(self, samples: Sequence[Sample]) -> None:
        """The same from any event loop (the asynchronous rollout scheduler's): the requests run on
        this teacher's own loop thread."""
        fut = asyncio.run_coroutine_threadsafe(self._score_all(samples), self.pool.loop)
        await asyncio.wrap_future(fut)

    async def _score_all(self, samples: Sequence[Sample]) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        results = await asyncio.gather(*(self._score_one(s) for s in samples))
        for s, res in zip(samples, results):
            s.teacher = res

    async def _score_one(self, s: Sample) -> TeacherScores:
        from mcore_rl.rollout.client import EngineError  # lazy: aiohttp

        if not s.response_ids:
            return TeacherScores(source=self.name, error="empty response")
        self._count += 1
        body = scoring_body(s.prompt_ids, s.response_ids, self.top_k, f"teacher-{self.name}-{s.group}-{self._count}")
        sem = self._sem
        assert sem is not None  # made by _score_all
        async with sem:
            try:
                reply = await self.pool.router.generate(body)
            except EngineError as err:  # every engine of the teacher failed, or one refused the request
                logger.warning("teacher %s could not score a sample of group %s: %s", self.name, s.group, err)
                return TeacherScores(source=self.name, error=f"{type(err).__name__}: {err}")
        engine = str(reply.get("meta_info", {}).get("engine", "")) if isinstance(reply, dict) else ""
        try:
            scores = parse_scores(reply, s.response_ids, self.top_k, self.vocab_size, f"{self.name}@{engine}")
        except ValueError as err:
            logger.warning("teacher %s (%s) gave an unusable reply for group %s: %s", self.name, engine, s.group, err)
            return TeacherScores(source=self.name, error=f"bad reply from {engine}: {err}")
        if self.reference is not None:  # on the reference's own event-loop thread
            fut = asyncio.run_coroutine_threadsafe(self.reference._reference_one(s, scores), self.reference.pool.loop)
            scores = await asyncio.wrap_future(fut)
        return scores

    async def _reference_one(self, s: Sample, main: TeacherScores) -> TeacherScores:
        """`main` (the teacher's scores of `s`) with this reference's `ref_logp` / `ref_topk_logp`;
        on failure marked (error set, lists empty) like a failure of the teacher itself."""
        from mcore_rl.rollout.client import EngineError  # lazy: aiohttp

        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        self._count += 1
        body, ids = reference_body(
            s.prompt_ids, s.response_ids, main.topk_ids, f"reference-{self.name}-{s.group}-{self._count}"
        )
        async with self._sem:
            try:
                reply = await self.pool.router.generate(body)
            except EngineError as err:
                logger.warning("reference %s could not score a sample of group %s: %s", self.name, s.group, err)
                return TeacherScores(source=main.source, error=f"reference {self.name}: {type(err).__name__}: {err}")
        engine = str(reply.get("meta_info", {}).get("engine", "")) if isinstance(reply, dict) else ""
        try:
            ref_logp, ref_topk = parse_reference(reply, s.response_ids, main.topk_ids, ids, self.vocab_size)
        except (ValueError, KeyError, TypeError) as err:
            logger.warning("reference %s (%s) gave an unusable reply for group %s: %s", self.name, engine, s.group, err)
            return TeacherScores(source=main.source, error=f"reference {self.name}: bad reply from {engine}: {err}")
        return dataclasses.replace(main, ref_logp=ref_logp, ref_topk_logp=ref_topk)

    def close(self) -> None:
        self.pool.close()


def check_engines(pool: Any, urls: Sequence[str], tokenizer: Any, who: str, whose: str, error: type) -> None:
    """Every engine of `pool` at `urls` answers and tokenizes like `tokenizer`; else `error` naming
    `who` (e.g. "teachers[0] (math): the teacher engine") and the engine, before training starts."""
    from mcore_rl.rollout.client import EngineError  # lazy: aiohttp

    for url in urls:
        client = pool.router.clients[url]
        try:
            pool._run(client.get_model_info())
        except EngineError as err:
            raise error(f"{who} {url} is unreachable: {err}") from None
        problem = pool._run(check_tokenizer(client, tokenizer))
        if problem is not None:
            raise error(f"{who} {url} does not share {whose} tokenizer (data.tokenizer_path): {problem}")


async def check_tokenizer(client: Any, tokenizer: Any) -> str | None:
    """None if the engine behind `client` tokenizes like `tokenizer`, else what differs.

    Over HTTP, with SGLang's own endpoints: `/tokenize` of the probe texts (`data/tokenizer_match.py`:
    words, digits, whitespace, unicode, code and the student's special-token strings; no special
    tokens added) must give the student's ids, and `/detokenize` of ids spread over the student's
    vocabulary (its last id and its special ids included) its text. A server without `/tokenize` (older SGLang: 404) is probed through
    `/generate` instead: the ids it reports for a scored text prompt (a leading BOS allowed)."""
    from mcore_rl.rollout.client import EngineHTTPError  # lazy: aiohttp

    texts = probe_texts(tokenizer)
    want = [list(tokenizer.encode(t)) for t in texts]
    try:
        got = (await client.tokenize(prompt=texts, add_special_tokens=False))["tokens"]
    except EngineHTTPError as err:
        if err.status != 404:
            raise
        return await _check_by_generate(client, tokenizer, texts, want)
    for text, w, g in zip(texts, want, got):
        if list(g) != w:
            return f"/tokenize of {text!r} gives {short_ids(g)}, the student's tokenizer {short_ids(w)}"
    ids = probe_ids(tokenizer)
    texts_back = (await client.detokenize(tokens=[[i] for i in ids], skip_special_tokens=False))["text"]
    for i, text in zip(ids, texts_back):
        mine = tokenizer.decode([i], skip_special_tokens=False)
        if text != mine:
            return f"/detokenize of token {i} gives {text!r}, the student's tokenizer {mine!r}"
    return None


async def _check_by_generate(client: Any, tokenizer: Any, texts: list[str], want: list[list[int]]) -> str | None:
    bos = getattr(tokenizer, "bos_id", None)
    for text, w in zip(texts, want):
        reply = await client.generate(
            text=text, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )
        got = [e[1] for e in reply["meta_info"]["input_token_logprobs"]]
        if got != w and not (bos is not None and got == [bos] + w):
            return f"/generate tokenizes {text!r} as {short_ids(got)}, the student's tokenizer as {short_ids(w)}"
    return None


def start_teacher_engines(
    model_path: str,
    *,
    num: int,
    workdir: str,
    tokenizer_path: str | None = None,
    context_length: int = 1024,
    max_running_requests: int = 64,
    quantization: str = "none",
    cores: Sequence[Sequence[int]] | None = None,
    threads: int | None = None,
    startup_timeout_s: float = 300.0,
) -> Any:
    """`num` `mcore-rl serve` processes on the checkpoint `model_path` (HF format, with weights):
    the `EngineProcesses` to give `EngineTeacher(processes=...)`, which then owns them."""

    return EngineProcesses.start(
        None,
        num=num,
        workdir=workdir,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        context_length=context_length,
        max_running_requests=max_running_requests,
        quantization=quantization,
        cores=cores,
        threads=threads,
        startup_timeout_s=startup_timeout_s,
    )
