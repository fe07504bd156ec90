"""Repairing zero-signal groups of a synchronous rollout batch: POLARIS's rollout rescue and
intra-batch substitution, EDGE-GRPO's guided error correction (GEC).

The decisions (which groups, which samples, which op) are pure functions in `mcore_rl.algos.polaris`
and `mcore_rl.algos.edge_gec`; this module applies them to `Sample`s, after the batch is scored:

* **Rescue** (`rollout.polaris.rescue`): a `RescueBuffer` keeps, per prompt (domain, text), the latest
  correct rollout seen, bounded to `rescue_buffer_prompts` prompts (the least recently updated go).
  A rescued sample is that stored rollout as it was generated: its tokens, its μ and its (older)
  `policy_version`, so the mismatch correction weighs it by π_old/μ like any stale sample; it is
  marked `info["polaris_rescued"]` and the synchronous loop exempts it from `rollout.max_staleness`
  (it is stale by design). The buffer is part of the checkpoint (the loop's rollout state).
* **Substitution** (`rollout.polaris.substitute`): every constant-reward group is replaced by copies
  of a mixed group's samples; the copies keep the group id of the group they replace (so group
  statistics see each copy as its own group, as in the paper) and say where they came from in
  `info["polaris_substituted_from"]`.
* **GEC** (`rollout.gec`): ops 1/2 (reflection, reflection + answer) generate a continuation of
  `prompt + wrong response + reflection [+ answer hint]`; the repaired sample's `prompt.ids` is that
  whole context (its `prompt.text` stays the original, which the reward verifies against) and its
  response is the continuation only, so the trainer conditions on the repair context and the
  injected text is never trained on. The continuation gets the prompt's budget, cut so that context
  and continuation fit `train.seq_length` and the engine's context (no room: the sample stays as it
  was, counted as `gec_no_room`). Op 3 replaces
  the response by the task's answer (+ eos), conditioned on the original prompt, with μ the engine's
  prompt-scoring log-probs of those tokens (taken at temperature 1, as SGLang's input log-probs are).
  A task whose label has no answer text (`answer_text` is None) gets op 1 instead of ops 2/3.
  Every repaired sample is scored again by the domain's reward.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, replace
from typing import Any, Optional, Sequence

import torch

from mcore_rl.algos.dynamic_sampling import DEFAULT_STD_TOLERANCE
from mcore_rl.algos.edge_gec import INJECT, REFERENCE, REFLECT, gec_ops
from mcore_rl.algos.polaris import rescue_plan, substitution_plan
from mcore_rl.data.samples import Sample
from mcore_rl.rollout.pool import GenRequest

SALT_GEC = 4  # sampling seeds of GEC's continuations (apart from the rollout's salts 1-3)


def _flat(groups: Sequence[Sequence[Sample]]) -> tuple[list[Sample], torch.Tensor, torch.Tensor]:
    flat = [s for g in groups for s in g]
    ids = torch.tensor([k for k, g in enumerate(groups) for _ in g], dtype=torch.long)
    return flat, torch.tensor([s.reward for s in flat], dtype=torch.float64), ids


def _key(s: Sample) -> tuple[str, str]:
    return s.prompt.domain, s.prompt.text


def _split(flat: list[Sample], groups: Sequence[Sequence[Sample]]) -> list[list[Sample]]:
    out, k = [], 0
    for g in groups:
        out.append(flat[k:k + len(g)])
        k += len(g)
    return out


class RescueBuffer:
    """POLARIS's rescue buffer: per prompt, the latest correct rollout (a copy), at most `max_prompts`."""

    def __init__(self, max_prompts: int, correct_reward: float = 1.0) -> None:
        self.max_prompts, self.correct_reward = max_prompts, correct_reward
        self.entries: OrderedDict[tuple[str, str], Sample] = OrderedDict()

    def has(self, s: Sample) -> bool:
        return _key(s) in self.entries

    def update(self, groups: Sequence[Sequence[Sample]]) -> int:
        """Store the correct rollouts of `groups` (the last one of a prompt wins; rescued and repaired
        samples are not stored). Returns how many were stored."""
        n = 0
        for g in groups:
            for s in g:
                if s.reward < self.correct_reward or s.reward_error is not None or s.info.get("polaris_rescued") \
                        or s.info.get("gec") or s.info.get("polaris_substituted_from") is not None:
                    continue
                key = _key(s)
                self.entries.pop(key, None)
                self.entries[key] = replace(s, teacher=None, info=dict(s.info))
                n += 1
        while len(self.entries) > self.max_prompts:
            self.entries.popitem(last=False)
        return n

    def rescue(self, groups: Sequence[Sequence[Sample]]) -> tuple[list[list[Sample]], int]:
        """Every all-wrong group with a stored rollout of its prompt: its last wrong sample replaced
        by that rollout (in the group's id and prompt). Returns the groups and how many were rescued."""
        flat, rewards, ids = _flat(groups)
        plan = rescue_plan(rewards, ids, [self.has(s) for s in flat], correct_reward=self.correct_reward)
        for i in plan.values():
            old, stored = flat[i], self.entries[_key(flat[i])]
            flat[i] = replace(stored, prompt=old.prompt, group=old.group, teacher=None,
                              info={**stored.info, "polaris_rescued": True})
        return _split(flat, groups), len(plan)

    def state_dict(self) -> dict[str, Any]:
        return {"max_prompts": self.max_prompts, "entries": [asdict(s) for s in self.entries.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from mcore_rl.runtime.scheduler import _sample_from_state

        self.entries = OrderedDict()
        for d in state["entries"]:
            s = _sample_from_state(d)
            self.entries[_key(s)] = s
        while len(self.entries) > self.max_prompts:
            self.entries.popitem(last=False)


def substitute(groups: Sequence[Sequence[Sample]],
               tol: float = DEFAULT_STD_TOLERANCE) -> tuple[list[list[Sample]], int]:
    """POLARIS's intra-batch substitution: (groups, how many groups were replaced)."""
    flat, rewards, ids = _flat(groups)
    src = substitution_plan(rewards, ids, tol=tol)
    out = list(flat)
    replaced = set()
    for i, j in enumerate(src):
        if i != j:
            out[i] = replace(flat[j], group=flat[i].group,
                             info={**flat[j].info, "polaris_substituted_from": flat[j].group})
            replaced.add(int(ids[i]))
    return _split(out, groups), len(replaced)


def answer_text(label: Any) -> Optional[str]:
    """The task's ground-truth answer as text (a string label, or a dict's "answer"); None if none."""
    if isinstance(label, dict):
        label = label.get("answer")
    if isinstance(label, bool) or label is None:
        return None
    return label if isinstance(label, str) else str(label) if isinstance(label, (int, float)) else None


def guided_error_correction(manager: Any, groups: Sequence[Sequence[Sample]], tokenizer: Any,
                            temperature: float) -> tuple[list[list[Sample]], dict[str, int]]:
    """EDGE-GRPO's GEC on a scored batch (see the module docstring): (groups, counts per op)."""
    from mcore_rl.runtime.rollout_manager import sample_seed

    g = manager.cfg.rollout.gec
    seed = manager.cfg.train.seed
    flat = [s for grp in groups for s in grp]
    keys = [(s.prompt.index, j) for grp in groups for j, s in enumerate(grp)]
    wrong = [s.reward < g.correct_reward and not s.info.get("polaris_rescued") for s in flat]
    ops = gec_ops(wrong, keys, seed=seed, probs=g.probs)
    counts = {"reflect": 0, "inject": 0, "reference": 0, "no_room": 0, "fixed": 0}
    eos = tokenizer.eos_id
    regen: list[tuple[int, list[int], GenRequest, int]] = []  # (flat index, context, request, op)
    score: list[tuple[int, GenRequest, list[int], str]] = []  # (flat index, request, reference ids, text)
    for i, (s, op) in enumerate(zip(flat, ops)):
        if op == 0:
            continue
        answer = answer_text(s.prompt.label)
        if answer is None:
            op = REFLECT
        if op == REFERENCE:
            ref = tokenizer.encode(answer) + [eos]
            req = GenRequest(s.prompt.ids + ref, {"temperature": 0.0, "max_new_tokens": 1},
                             logprob_start_len=len(s.prompt.ids) - 1)
            score.append((i, req, ref, answer))
            continue
        response = list(s.response_ids)
        if response and response[-1] == eos:
            response = response[:-1]
        text = g.reflection + (g.answer_hint.format(answer=answer) if op == INJECT else "")
        context = s.prompt.ids + response + tokenizer.encode(text)
        cfg = manager.cfg
        room = min(manager.budget(s.prompt), cfg.train.seq_length - len(context),
                   cfg.rollout.context_length - len(context))
        if room < 1:
            counts["no_room"] += 1
            continue
        sp = manager.sampling_params(temperature, sample_seed(seed, SALT_GEC, keys[i][0], keys[i][1]), room,
                                     s.prompt.domain)
        regen.append((i, context, GenRequest(context, sp), op))
    reqs = [r for _, _, r, _ in regen] + [r for _, r, _, _ in score]
    gens = manager.engines.generate(reqs) if reqs else []
    repaired: dict[int, str] = {}  # flat index -> op name
    for (i, context, _, op), gen in zip(regen, gens[:len(regen)]):
        s = flat[i]
        if len(gen.output_logprobs) != len(gen.output_ids):
            raise RuntimeError(f"engine {gen.engine} returned {len(gen.output_logprobs)} log-probs for "
                               f"{len(gen.output_ids)} tokens")
        flat[i] = Sample(replace(s.prompt, ids=context), s.group, list(gen.output_ids), list(gen.output_logprobs),
                         gen.weight_version, gen.finish_reason, gen.text, gen.engine,
                         info={})
        repaired[i] = "reflect" if op == REFLECT else "inject"
        counts[repaired[i]] += 1
    for (i, _, ref, answer), gen in zip(score, gens[len(regen):]):
        s = flat[i]
        if gen.input_logprobs is None or len(gen.input_logprobs) != len(ref):
            raise RuntimeError(f"engine {gen.engine} returned no prompt log-probs for the {len(ref)} reference tokens")
        flat[i] = Sample(s.prompt, s.group, ref, list(gen.input_logprobs), gen.weight_version, "stop", answer,
                         gen.engine)
        repaired[i] = "reference"
        counts["reference"] += 1
    if repaired:
        manager.score([flat[i] for i in repaired])  # (scoring resets `info`: the op is marked after it)
        for i, op_name in repaired.items():
            flat[i].info["gec"] = op_name
        counts["fixed"] = sum(flat[i].reward >= g.correct_reward for i in repaired)
    return _split(flat, groups), counts
