"""EDGE-GRPO's guided error correction (GEC; "EDGE-GRPO: Entropy-Driven GRPO with Guided Error
Correction", Beihang, 2025): each wrong response of a rollout round, with probabilities
`rollout.gec.probs`, regenerated after a reflection, after a reflection and the answer, or replaced
by the reference solution. The choice of op is `mcore_rl.algos.edge_gec.gec_ops` (pure).

Ops 1/2 (reflection, reflection + answer) generate a continuation of
`prompt + wrong response + reflection [+ answer hint]`; the repaired sample's `prompt.ids` is that
whole context (its `prompt.text` stays the original, which the reward verifies against) and its
response is the continuation only, so the trainer conditions on the repair context and the
injected text is never trained on. The continuation gets the prompt's budget, cut so that context
and continuation fit `train.seq_length` and the engine's context (no room: the sample stays as it
was, counted as `gec_no_room`). Op 3 replaces the response by the task's answer (+ eos),
conditioned on the original prompt, with μ the engine's prompt-scoring log-probs of those tokens
(taken at temperature 1, as SGLang's input log-probs are). A task whose label has no answer text
(`answer_text` is None) gets op 1 instead of ops 2/3. Every repaired sample is scored again by the
domain's reward.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from collections.abc import Sequence

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos.edge_gec import INJECT, REFERENCE, REFLECT, gec_ops
from mcore_rl.config.rules import Errors
from mcore_rl.data.samples import Sample
from mcore_rl.recipes.config.gec import GECConfig
from mcore_rl.hooks import Recipe, RolloutContext
from mcore_rl.rollout.pool import GenRequest
from mcore_rl.runtime.rollout_manager import sample_seed, split_groups

SALT_GEC = 4  # sampling seeds of GEC's continuations (apart from the rollout's salts 1-3)


def answer_text(label: Any) -> str | None:
    """The task's ground-truth answer as text (a string label, or a dict's "answer"); None if none."""
    if isinstance(label, dict):
        label = label.get("answer")
    if isinstance(label, bool) or label is None:
        return None
    return label if isinstance(label, str) else str(label) if isinstance(label, (int, float)) else None


async def guided_error_correction(
    rollout: RolloutContext, groups: Sequence[Sequence[Sample]]
) -> tuple[list[list[Sample]], dict[str, int]]:
    """EDGE-GRPO's GEC on a round of scored groups (see the module docstring): (groups, counts per op)."""
    g = rollout.cfg.rollout.section(GECConfig)
    seed = rollout.cfg.train.seed
    tokenizer, temperature = rollout.tokenizer, rollout.temperature
    flat = [s for grp in groups for s in grp]
    keys = [(s.prompt.index, j) for grp in groups for j, s in enumerate(grp)]
    wrong = [s.reward < g.correct_reward and not s.marks.rescued for s in flat]
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
        if op == REFERENCE and answer is not None:  # (an op without an answer became REFLECT above)
            ref = tokenizer.encode(answer) + [eos]
            req = GenRequest(
                s.prompt.ids + ref, {"temperature": 0.0, "max_new_tokens": 1}, logprob_start_len=len(s.prompt.ids) - 1
            )
            score.append((i, req, ref, answer))
            continue
        response = list(s.response_ids)
        if response and response[-1] == eos:
            response = response[:-1]
        text = g.reflection + (g.answer_hint.format(answer=answer) if op == INJECT else "")
        context = s.prompt.ids + response + tokenizer.encode(text)
        cfg = rollout.cfg
        room = min(
            rollout.budget(s.prompt), cfg.train.seq_length - len(context), cfg.rollout.context_length - len(context)
        )
        if room < 1:
            counts["no_room"] += 1
            continue
        sp = rollout.sampling_params(
            temperature, sample_seed(seed, SALT_GEC, keys[i][0], keys[i][1]), room, s.prompt.domain
        )
        regen.append((i, context, GenRequest(context, sp), op))
    reqs = [r for _, _, r, _ in regen] + [r for _, r, _, _ in score]
    gens = await rollout.generate_many(reqs) if reqs else []
    repaired: dict[int, str] = {}  # flat index -> op name
    for (i, context, _, op), gen in zip(regen, gens[: len(regen)]):
        s = flat[i]
        if len(gen.output_logprobs) != len(gen.output_ids):
            raise RuntimeError(
                f"engine {gen.engine} returned {len(gen.output_logprobs)} log-probs for {len(gen.output_ids)} tokens"
            )
        flat[i] = Sample(
            replace(s.prompt, ids=context),
            s.group,
            list(gen.output_ids),
            list(gen.output_logprobs),
            gen.weight_version,
            gen.finish_reason,
            gen.text,
            gen.engine,
            info={},
        )
        repaired[i] = "reflect" if op == REFLECT else "inject"
        counts[repaired[i]] += 1
    for (i, _, ref, answer), gen in zip(score, gens[len(regen) :]):
        s = flat[i]
        if gen.input_logprobs is None or len(gen.input_logprobs) != len(ref):
            raise RuntimeError(f"engine {gen.engine} returned no prompt log-probs for the {len(ref)} reference tokens")
        flat[i] = Sample(
            s.prompt, s.group, ref, list(gen.input_logprobs), gen.weight_version, "stop", answer, gen.engine
        )
        repaired[i] = "reference"
        counts["reference"] += 1
    if repaired:
        await rollout.score_rewards([flat[i] for i in repaired])
        for i, op_name in repaired.items():
            flat[i].marks = replace(flat[i].marks, corrected_by=op_name)
        counts["fixed"] = sum(flat[i].reward >= g.correct_reward for i in repaired)
    return split_groups(flat, groups), counts


class GuidedErrorCorrection(Recipe):
    """GEC on every round of scored training groups (after POLARIS's rescue, which it leaves alone)."""

    name = "gec"

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        return cfg.rollout.section(GECConfig).enabled

    @classmethod
    def check(cls, cfg: RLConfig, errors: Errors) -> None:
        r, g = cfg.rollout, cfg.rollout.section(GECConfig)
        if not g.enabled:
            return
        probs = list(g.probs)
        errors.need(
            len(probs) == 3 and min(probs, default=-1) >= 0 and abs(sum(probs) - 1) <= 1e-9,
            "rollout.gec.probs",
            "must be three non-negative probabilities (reflect, reflect + answer, "
            f"reference) summing to 1, got {probs}",
        )
        if len(probs) == 3 and probs[1] > 0:
            try:
                g.answer_hint.format(answer="1")
            except (KeyError, IndexError, ValueError) as err:
                errors.need(False, "rollout.gec.answer_hint", f"must be a format string with only {{answer}}: {err!r}")
        errors.need(
            not r.sampling_mask_replay,
            "rollout.gec.enabled",
            "a reference solution (op 3) was not sampled, so it has no sampling mask; turn off "
            "rollout.sampling_mask_replay",
        )
        errors.need(
            cfg.algorithm.routing_replay != "r3",
            "rollout.gec.enabled",
            "repaired responses have no engine routing of their training context; use "
            "algorithm.routing_replay r2 or none",
        )

    async def repair_round(
        self, groups: list[list[Sample]], rollout: RolloutContext
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        groups, counts = await guided_error_correction(rollout, groups)
        return groups, {f"gec_{k}": float(v) for k, v in counts.items()}
