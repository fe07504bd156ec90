"""The teachers of on-policy distillation, all kinds behind one `Teachers` set (config `teachers:`).

In-trainer teachers are a forward pass of megatron model chunks over the student's own response
tokens, collective over the trainer world like `Learner.token_logprobs` (every rank holds the same
samples and gets the same log-probs):

* `PrivilegedTeacher`: the policy itself (same weights, same step) on a different prompt: the
  student's prompt with privileged context put in front of it (after a leading bos), from the
  prompt's correct answer (`Prompt.label`), the best successful peer of the same group (its
  response text; reward >= `peer_min_reward`, the sample itself excluded), the first successful
  *other episode* of the same group, its turns in step order (`peer_episode`: StepOPSD's hindsight,
  for the step samples of multi-turn episodes), or a field of `Sample.info` (a retrieved skill, a
  hindsight lesson, the environment's `privileged/*`). A sample without such context, or whose
  privileged prompt + response does not fit a packed row, is marked and gets no distillation term.
  With `refresh_interval: N` it reads a copy of the policy taken every N rollout steps instead of
  the current weights (StepOPSD's stale teacher: the policy of up to N steps ago, with hindsight).
* `FrozenTeacher`: an older copy of the student in chunks of its own (like the KL's reference
  model): the weights at the start (or of `checkpoint`), taken again every `refresh_interval`
  rollout steps. On resume the copy is taken from the resumed weights (its age restarts).

An engine teacher may have a reference (`reference:`, another engine teacher, never routed to)
that scores, for every sample the teacher scored, the same tokens and the teacher's top-k ids
(Direct-OPD's π_Tref; `EngineTeacher.reference`).

Engine teachers (`rollout/teacher.py`) are scored on rank 0, which holds the engines, and their
scores are broadcast. Each sample has at most one teacher, routed by its domain
(`route_by_domain`, UI-MOPD). With `top_k`, an in-trainer teacher also gives its k most likely
tokens per response position (`vocab_parallel_topk`: each TP rank's top-k of its vocabulary
shard, all-gathered, k values per token and rank; the full vocabulary is never gathered), in a
second forward-only pass over the same packed micro-batches.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch

from mcore_rl.config.rl_schema import RLConfig, TeacherConfig
from mcore_rl.data.samples import Sample, TeacherScores
from mcore_rl.rollout.engine_processes import start_engine_group
from mcore_rl.rollout.teacher import EngineTeacher, TeacherError, route_by_domain
from mcore_rl.models.vocab_padding import mask_padded_logits
from mcore_rl.train.logprobs import auto_chunk_size
from mcore_rl.train.logprobs import _decoder_output_only, output_weight, tp_region, unwrap_gpt
from mcore_rl.train.packing import build_microbatches
from mcore_rl.config.rl_validate import teacher_name
from mcore_rl.train.policy import build_reference_model, copy_weights
from mcore_rl.config.rl_validate import reference_teachers
from mcore_rl.train.warm_start import load_initial_weights

logger = logging.getLogger(__name__)

# token_logprobs(samples, num_positions, chunks) -> [N, T] log-probs of the response tokens (Learner's)
LogprobFn = Callable[[Sequence[Sample], int, list | None], torch.Tensor]
# topk(samples, num_positions, chunks) -> ([N, T, k] log-probs, [N, T, k] ids) of the k most likely tokens
TopkFn = Callable[[Sequence[Sample], int, list | None], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def vocab_parallel_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and global ids ([n, k] each, most likely first) of the k most likely tokens per
    row of hidden [n, h], from this TP rank's [vocab/TP, h] output-weight shard. The softmax
    normaliser is all-reduced (max, sum of exponentials) and each rank's own top-k all-gathered:
    k values per token and rank cross ranks, never the vocabulary. `vocab_size`: the true size of a
    padded vocabulary, whose padded ids are masked (never chosen, not in the normaliser)."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(tp_group) if tp > 1 else 0
    local = weight.shape[0]
    chunk = chunk_size or auto_chunk_size(local)
    kk = min(k, local)
    vals, ids = [], []
    for s in range(0, hidden.shape[0], chunk):
        z = mask_padded_logits((hidden[s : s + chunk] @ weight.t()).float() / temperature, vocab_size, rank * local)
        zmax = z.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=tp_group)
        total = (z - zmax[:, None]).exp().sum(dim=-1)
        if tp > 1:
            dist.all_reduce(total, group=tp_group)
        lse = total.log() + zmax
        v, i = z.topk(kk, dim=-1)
        i = i + rank * local
        if tp > 1:
            all_v = [torch.empty_like(v) for _ in range(tp)]
            all_i = [torch.empty_like(i) for _ in range(tp)]
            dist.all_gather(all_v, v.contiguous(), group=tp_group)
            dist.all_gather(all_i, i.contiguous(), group=tp_group)
            v, pick = torch.cat(all_v, dim=-1).topk(k, dim=-1)
            i = torch.cat(all_i, dim=-1).gather(-1, pick)
        vals.append(v - lse[:, None])
        ids.append(i)
    return torch.cat(vals), torch.cat(ids)


@torch.no_grad()
def token_topk(
    chunks: list,
    samples: Sequence[Sample],
    num_positions: int,
    k: int,
    *,
    seq_length: int,
    micro_batch_size: int,
    pad_id: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T, k] log-probs and ids of the k most likely tokens at every response position of
    `samples` under `chunks` (packed as the learner packs them), identical on every rank."""
    from functools import partial

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_rl.train.forward_backward import attention_mask_from_segments, forward_backward  # lazy: megatron

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mbs = build_microbatches(
        samples, range(len(samples)), seq_length, micro_batch_size, dp_rank, dp_size, pad_id, num_positions
    )
    store: list[tuple[torch.Tensor, torch.Tensor]] = []

    def collect(out: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        store.append(out)
        zero = torch.zeros((), device=out[0].device)
        return zero, torch.tensor(1, dtype=torch.int), {"lm_loss": torch.zeros(2, device=out[0].device)}

    def step(data_iterator: Any, model: torch.nn.Module) -> tuple:
        batch = next(data_iterator)
        gpt = unwrap_gpt(model)
        with _decoder_output_only(gpt):
            mask = attention_mask_from_segments(batch.get("segment_ids"))
            hidden = model(batch["tokens"], batch["position_ids"], mask)
        if not gpt.post_process:
            return hidden, collect
        hidden = tp_region(hidden, gpt.config.sequence_parallel)  # [s, b, h]
        s, b, h = hidden.shape
        v, i = vocab_parallel_topk(
            hidden.reshape(s * b, h),
            output_weight(gpt),
            k,
            temperature,
            chunk_size,
            ps.get_tensor_model_parallel_group(),
            getattr(gpt, "unpadded_vocab_size", None),
        )
        return (v.view(s, b, k).transpose(0, 1), i.view(s, b, k).transpose(0, 1)), partial(collect)

    for c in chunks:
        c.eval()
    model_in = [{key: val for key, val in mb.items() if key not in ("seq_index", "seq_pos")} for mb in mbs]
    forward_backward(chunks, model_in, forward_only=True, forward_step=step)
    pp = ps.get_pipeline_model_parallel_world_size()
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    n = len(samples)
    vals = torch.zeros(n, num_positions, k)
    ids = torch.zeros(n, num_positions, k, dtype=torch.long)
    if last:
        for mb, (v, i) in zip(mbs, store):
            if mb["seq_index"].numel() == 0:
                continue
            vals[mb["seq_index"]] = v.reshape(-1, k).cpu()[mb["seq_pos"]]
            ids[mb["seq_index"]] = i.reshape(-1, k).cpu()[mb["seq_pos"]]
    device = next(chunks[0].parameters()).device
    if dist.is_initialized() and dist.get_backend() != "nccl":
        device = torch.device("cpu")
    for t in (vals, ids):
        buf = t.to(device)
        if dp_size > 1:  # each sample lives on exactly one DP rank
            dist.all_reduce(buf, group=ps.get_data_parallel_group())
        if pp > 1:  # the last stage has them
            dist.broadcast(
                buf, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
        t.copy_(buf.cpu())
    return vals, ids


def answer_of_label(label: Any) -> str | None:
    """The reference answer a label holds: the label itself, or the `answer` field of a structured
    label (a reasoning-gym entry is a dict whose `metadata` the scorer needs); None when it has none.
    Putting a whole dict in front of the prompt would show the teacher its metadata, not an answer."""
    if isinstance(label, Mapping):
        label = label.get("answer")
    return None if label is None or label == "" else str(label)


def privileged_context(
    sample: Sample, batch: Sequence[Sample], source: str, key: str = "skill", peer_min_reward: float = 1.0
) -> str | None:
    """The privileged text for `sample` (None when there is none): see the module docstring."""
    if source == "answer":
        return answer_of_label(sample.prompt.label)
    if source == "info":
        value = sample.info.get(key)
        return None if value is None or value == "" else str(value)
    if source == "peer":
        peers = [
            s
            for s in batch
            if s is not sample
            and s.group == sample.group
            and s.reward_error is None
            and s.finish_reason != "abort"
            and s.reward >= peer_min_reward
            and s.text
        ]
        if not peers:
            return None
        best = max(peers, key=lambda s: s.reward)  # the first of equals: batch order
        return best.text
    if source == "peer_episode":
        return peer_episode(sample, batch, peer_min_reward)
    raise ValueError(f"context: unknown privileged-context source {source!r} (answer, peer, peer_episode, info)")


def peer_episode(sample: Sample, batch: Sequence[Sample], min_reward: float) -> str | None:
    """StepOPSD's hindsight: the turns of the first episode (batch order) of `sample`'s group, other than
    its own, whose return is at least `min_reward` and that no error cost, as "Step k: text" lines in
    step order; None when the group has none (or `sample` is not a step of an episode)."""
    if sample.episode is None:
        return None
    steps: dict[int, list[Sample]] = {}
    for s in batch:
        if s.group == sample.group and s.episode is not None and s.episode != sample.episode:
            steps.setdefault(s.episode, []).append(s)
    for ep in steps.values():
        if all(s.reward_error is None and s.reward >= min_reward for s in ep):
            turns = sorted(ep, key=lambda s: s.step_index or 0)
            return "\n".join(f"Step {k + 1}: {s.text.strip()}" for k, s in enumerate(turns))
    return None


def with_context(sample: Sample, context_ids: Sequence[int], bos_id: int | None) -> Sample:
    """A copy of `sample` whose prompt has `context_ids` in front (after its leading bos, if any);
    the response tokens are the same objects."""
    ids = sample.prompt.ids
    head = 1 if bos_id is not None and ids and ids[0] == bos_id else 0
    prompt = dataclasses.replace(sample.prompt, ids=list(ids[:head]) + list(context_ids) + list(ids[head:]))
    return dataclasses.replace(sample, prompt=prompt)


class PolicyCopy:
    """The student's weights in chunks of their own (like the KL's reference model): taken at the
    start (or from a checkpoint), and again after every `refresh_interval`-th rollout step (0: never).
    `version` is the policy version the copy holds ("checkpoint" for a checkpoint's weights)."""

    def __init__(
        self, cfg: RLConfig, policy_chunks: list, refresh_interval: int, checkpoint: str | None, version: int
    ) -> None:
        self.refresh_interval, self.policy_chunks = refresh_interval, policy_chunks
        self.chunks = build_reference_model(cfg)
        if checkpoint:
            load_initial_weights(checkpoint, self.chunks, logger.info)
            self.version: int | str = "checkpoint"
        else:
            copy_weights(self.chunks, policy_chunks)
            self.version = version

    def refresh(self, version: int) -> None:
        copy_weights(self.chunks, self.policy_chunks)
        self.version = version

    def step_done(self, rl_step: int, version: int) -> None:
        """After rollout step `rl_step` (whose update made weight `version`)."""
        if self.refresh_interval > 0 and rl_step % self.refresh_interval == 0:
            self.refresh(version)


class PrivilegedTeacher:
    """The policy with privileged context (see the module docstring): its current weights, or the
    `PolicyCopy` given as `copy` (a stale policy)."""

    kind = "privileged"

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        seq_length: int,
        *,
        context: str = "answer",
        context_key: str = "skill",
        template: str = "Reference solution: {context}\n",
        peer_min_reward: float = 1.0,
        top_k: int = 0,
        copy: PolicyCopy | None = None,
    ) -> None:
        self.name, self.tokenizer, self.seq_length, self.top_k = name, tokenizer, seq_length, top_k
        self.context, self.context_key, self.template = context, context_key, template
        self.peer_min_reward = peer_min_reward
        self.copy = copy

    @property
    def chunks(self) -> list | None:
        """The chunks that score: the copy's, or None (the policy's own)."""
        return None if self.copy is None else self.copy.chunks

    @property
    def source(self) -> str:
        return self.name if self.copy is None else f"{self.name}:{self.copy.version}"

    def step_done(self, rl_step: int, version: int) -> None:
        if self.copy is not None:
            self.copy.step_done(rl_step, version)

    def privileged_samples(self, samples: Sequence[Sample], batch: Sequence[Sample]) -> list[Sample | None]:
        """Each sample with its privileged prompt; None (marked by `score`) when it has no context or
        does not fit a row of train.seq_length + 1 tokens."""
        out: list[Sample | None] = []
        for s in samples:
            ctx = privileged_context(s, batch, self.context, self.context_key, self.peer_min_reward)
            if ctx is None:
                out.append(None)
                continue
            p = with_context(
                s, self.tokenizer.encode(self.template.format(context=ctx)), getattr(self.tokenizer, "bos_id", None)
            )
            out.append(p if len(p.prompt_ids) + len(p.response_ids) <= self.seq_length + 1 else None)
        return out

    def score(
        self, samples: Sequence[Sample], batch: Sequence[Sample], logprobs: LogprobFn, topk: TopkFn | None = None
    ) -> None:
        priv = self.privileged_samples(samples, batch)
        usable = [p for p in priv if p is not None and p.response_ids]
        width = max([len(p.response_ids) for p in usable] + [1])
        lp = logprobs(usable, width, self.chunks) if usable else None
        top = topk(usable, width, self.chunks) if usable and self.top_k and topk is not None else None
        k = 0
        for s, p in zip(samples, priv):
            if p is None or not p.response_ids:
                why = (
                    "empty response"
                    if not s.response_ids
                    else "no privileged context"
                    if privileged_context(s, batch, self.context, self.context_key, self.peer_min_reward) is None
                    else f"privileged prompt + response longer than train.seq_length + 1 = {self.seq_length + 1}"
                )
                s.teacher = TeacherScores(source=self.source, error=why)
                continue
            assert lp is not None  # computed for the usable samples, this is one
            s.teacher = _scores(lp, top, k, len(s.response_ids), self.source)
            k += 1


class FrozenTeacher:
    """An older copy of the student (see the module docstring)."""

    kind = "frozen"

    def __init__(
        self,
        name: str,
        cfg: RLConfig,
        policy_chunks: list,
        *,
        refresh_interval: int = 0,
        checkpoint: str | None = None,
        version: int = 0,
        top_k: int = 0,
    ) -> None:
        self.name, self.top_k = name, top_k
        self.copy = PolicyCopy(cfg, policy_chunks, refresh_interval, checkpoint, version)
        self.chunks = self.copy.chunks

    def step_done(self, rl_step: int, version: int) -> None:
        """After rollout step `rl_step` (whose update made weight `version`)."""
        self.copy.step_done(rl_step, version)

    @property
    def source(self) -> str:
        return f"frozen:{self.copy.version}"

    def score(
        self, samples: Sequence[Sample], batch: Sequence[Sample], logprobs: LogprobFn, topk: TopkFn | None = None
    ) -> None:
        usable = [s for s in samples if s.response_ids]
        width = max([len(s.response_ids) for s in usable] + [1])
        lp = logprobs(usable, width, self.chunks) if usable else None
        top = topk(usable, width, self.chunks) if usable and self.top_k and topk is not None else None
        k = 0
        for s in samples:
            if not s.response_ids:
                s.teacher = TeacherScores(source=self.source, error="empty response")
                continue
            assert lp is not None  # computed for the samples with a response, this is one
            s.teacher = _scores(lp, top, k, len(s.response_ids), self.source)
            k += 1


def _scores(
    lp: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None, k: int, n: int, source: str
) -> TeacherScores:
    if top is None:
        return TeacherScores(logp=lp[k, :n].tolist(), source=source)
    return TeacherScores(
        logp=lp[k, :n].tolist(), topk_ids=top[1][k, :n].tolist(), topk_logp=top[0][k, :n].tolist(), source=source
    )


class Teachers:
    """Every configured teacher, in config order; `score` fills `Sample.teacher` for a batch.

    Engine teachers exist on rank 0 only (`engine_ranks`); in-trainer ones on every rank."""

    def __init__(self, configs: Sequence[TeacherConfig], teachers: Sequence[Any]) -> None:
        self.names = [teacher_name(t, i) for i, t in enumerate(configs)]
        self.domains = [list(t.domains) for t in configs]
        self.kinds = [t.kind for t in configs]
        self.teachers = list(teachers)  # None where an engine teacher lives on another rank
        # reference teachers (π_Tref of another one) are never routed to; `reference_of[j]`: whose
        self.references = reference_teachers(configs)
        self.reference_of = {
            j: [i for i, t in enumerate(configs) if t.reference == self.names[j]] for j in self.references
        }

    def __len__(self) -> int:
        return len(self.names)

    @property
    def engine_teachers(self) -> list[tuple[int, EngineTeacher]]:
        return [(i, t) for i, t in enumerate(self.teachers) if isinstance(t, EngineTeacher)]

    def route(self, samples: Sequence[Sample]) -> list[int | None]:
        return route_by_domain(self.domains, [s.prompt.domain for s in samples], skip=self.references)

    async def ascore_engines(self, samples: Sequence[Sample]) -> None:
        """Engine teachers only, from an event loop (the asynchronous scheduler, after rewards)."""
        import asyncio

        routes = self.route(samples)
        jobs = [
            t.ascore(mine) for i, t in self.engine_teachers if (mine := [s for s, r in zip(samples, routes) if r == i])
        ]
        await asyncio.gather(*jobs)

    def score(
        self,
        samples: Sequence[Sample],
        logprobs: LogprobFn,
        broadcast: Callable[[Any], Any],
        rank0: bool,
        topk: Callable[[int], TopkFn] | None = None,
    ) -> dict[str, float]:
        """Fill `Sample.teacher` of every routed sample (collective). Engine teachers score on rank 0
        what has no scores yet (the asynchronous scheduler may have scored it already) and the scores
        are broadcast; then each in-trainer teacher scores its samples on every rank."""
        start = time.perf_counter()
        routes = self.route(samples)
        late = 0  # engine-teacher samples scored here, on the learner's critical path
        if any(k == "engine" for k in self.kinds):
            payload = None
            if rank0:
                for i, t in self.engine_teachers:
                    todo = [s for s, r in zip(samples, routes) if r == i and s.teacher is None]
                    if todo:
                        t.score(todo)
                        late += len(todo)
                payload = ([s.teacher for s in samples], late)
            scores, late = broadcast(payload)
            for s, sc in zip(samples, scores):
                s.teacher = sc
        for i, t in enumerate(self.teachers):
            if isinstance(t, (PrivilegedTeacher, FrozenTeacher)):
                mine = [s for s, r in zip(samples, routes) if r == i]
                # collective: every rank has the same `mine`
                t.score(mine, samples, logprobs, topk(t.top_k) if topk is not None and t.top_k else None)
        out = self.metrics(samples, routes, time.perf_counter() - start)
        engine_samples = sum(r is not None and self.kinds[r] == "engine" for r in routes)
        if engine_samples:
            out["teacher/engine_scored_late_frac"] = late / engine_samples
        return out

    def metrics(self, samples: Sequence[Sample], routes: Sequence[int | None], seconds: float) -> dict[str, float]:
        out = {"time/teacher_s": seconds}
        n = max(len(samples), 1)
        out["teacher/routed_frac"] = sum(r is not None for r in routes) / n
        for i, name in enumerate(self.names):
            mine = [s for s, r in zip(samples, routes) if r == i]
            if not mine:
                continue
            out[f"teacher/{name}/samples"] = float(len(mine))
            out[f"teacher/{name}/error_frac"] = sum(
                s.teacher is None or s.teacher.error is not None for s in mine
            ) / len(mine)
        for j, mains in self.reference_of.items():  # a reference: the samples its teachers scored
            tag = f"reference {self.names[j]}:"
            asked = [
                s
                for s, r in zip(samples, routes)
                if r in mains and s.teacher is not None and (s.teacher.error is None or s.teacher.error.startswith(tag))
            ]
            if asked:
                out[f"teacher/{self.names[j]}/samples"] = float(len(asked))
                out[f"teacher/{self.names[j]}/error_frac"] = sum(
                    s.teacher is not None and s.teacher.error is not None for s in asked
                ) / len(asked)
        return out

    def step_done(self, rl_step: int, version: int) -> None:
        for t in self.teachers:
            if isinstance(t, (FrozenTeacher, PrivilegedTeacher)):
                t.step_done(rl_step, version)

    def close(self) -> None:
        for t in self.teachers:
            if isinstance(t, EngineTeacher):
                t.close()


def build_engine_teacher(
    t: TeacherConfig, i: int, name: str, cfg: RLConfig, tokenizer: Any, workdir: str
) -> EngineTeacher:
    """Connect to (or start) an engine teacher and check it: reachable, the student's tokenizer."""
    procs = start_engine_group(
        t,
        workdir=os.path.join(workdir, name),  # its own tokenizer: checked below
        context_length=cfg.rollout.context_length,
        startup_timeout_s=cfg.rollout.engine_startup_timeout_s,
    )
    urls = procs.urls if procs is not None else list(t.urls)
    try:
        teacher = EngineTeacher(
            name,
            urls,
            vocab_size=cfg.model.vocab_size,
            top_k=t.top_k,
            timeout=t.request_timeout_s,
            api_key=t.api_key,
            max_concurrency=t.max_concurrency,
            health_interval=cfg.rollout.health_check_interval_s,
            processes=procs,
        )
    except BaseException:
        if procs is not None:
            procs.close()
        raise
    try:
        teacher.check(tokenizer, f"teachers[{i}] ({name})")
    except BaseException:
        teacher.close()
        raise
    return teacher


def build_engine_teachers(cfg: RLConfig, tokenizer: Any, workdir: str) -> list[EngineTeacher | None]:
    """Rank 0, before training: every engine teacher connected and checked (`TeacherError` if one
    is unreachable or has another tokenizer); None for the other kinds."""

    out: list[EngineTeacher | None] = []
    try:
        for i, t in enumerate(cfg.teachers):
            out.append(
                build_engine_teacher(t, i, teacher_name(t, i), cfg, tokenizer, workdir) if t.kind == "engine" else None
            )
        names = [teacher_name(t, i) for i, t in enumerate(cfg.teachers)]
        for i, t in enumerate(cfg.teachers):  # a teacher's reference π_Tref (validated: another engine teacher)
            engine = out[i]
            if t.kind == "engine" and t.reference and engine is not None:  # (built above for every engine teacher)
                engine.reference = out[names.index(t.reference)]
    except BaseException:
        for made in out:
            if made is not None:
                made.close()
        raise
    return out


def build_teachers(
    cfg: RLConfig,
    tokenizer: Any,
    policy_chunks: list,
    engine_teachers: Sequence[EngineTeacher | None],
    version: int = 0,
) -> Teachers:
    """The `Teachers` of `cfg.teachers`: the engine teachers given (rank 0; None elsewhere) and the
    in-trainer ones built here (every rank)."""

    made: list[Any] = []
    for i, t in enumerate(cfg.teachers):
        name = teacher_name(t, i)
        if t.kind == "engine":
            made.append(engine_teachers[i] if i < len(engine_teachers) else None)
        elif t.kind == "privileged":
            made.append(
                PrivilegedTeacher(
                    name,
                    tokenizer,
                    cfg.train.seq_length,
                    context=t.context,
                    context_key=t.context_key,
                    template=t.template,
                    peer_min_reward=t.peer_min_reward,
                    top_k=t.top_k,
                    copy=PolicyCopy(cfg, policy_chunks, t.refresh_interval, None, version)
                    if t.refresh_interval > 0
                    else None,
                )
            )
        elif t.kind == "frozen":
            made.append(
                FrozenTeacher(
                    name,
                    cfg,
                    policy_chunks,
                    refresh_interval=t.refresh_interval,
                    checkpoint=t.checkpoint,
                    version=version,
                    top_k=t.top_k,
                )
            )
        else:
            raise TeacherError(f"teachers[{i}].kind: unknown teacher kind {t.kind!r}")
    return Teachers(cfg.teachers, made)
