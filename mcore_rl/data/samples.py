"""Prompts and samples with their provenance: the unit that flows from data to the learner.

Every sample carries what made it (docs/design.md#provenance): the policy (weight) version the engine
reported for it (per token when a partial rollout continued it across weight syncs; then
`policy_version` is the oldest), the engine's per-token log-probs μ of its response tokens, and
the position of its prompt in the data stream. The learner checks the versions against its staleness bound, the
mismatch correction uses μ, and a resumed run continues the prompt stream where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class Prompt:
    """One prompt of the stream: its text and ids, the reference answer, where it came from."""

    index: int  # position in the stream (global count of prompts drawn so far)
    text: str
    ids: list[int]
    label: Any = None
    domain: str = ""  # the task or file it came from (per-domain rewards and metrics key on it)
    max_new_tokens: int | None = None  # this prompt's response budget (capped by rollout.max_new_tokens)


@dataclass
class TeacherScores:
    """What a teacher said about a sample's response tokens (on-policy distillation).

    `logp[j]` is the teacher's log-prob of response token j; `topk_ids[j]` / `topk_logp[j]` are the
    teacher's k most likely tokens at that position and their log-probs (None when not asked for).
    Filled by an engine teacher at rollout time or by an in-trainer teacher before the update;
    `error` is set (and the lists left empty) when the teacher could not score the sample, which
    then gets no distillation term."""

    logp: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] | None = None
    topk_logp: list[list[float]] | None = None
    # the teacher's reference (its weights before RL) on the same tokens / the same top-k ids, for
    # methods that distil the teacher's shift log π_T - log π_Tref (Direct-OPD); None when not asked for
    ref_logp: list[float] | None = None
    ref_topk_logp: list[list[float]] | None = None
    source: str = ""  # which teacher (engine URL, "privileged", "frozen:<version>")
    error: str | None = None


# `Sample.info` key: per response token 1 where distillation may act, 0 elsewhere (a step's tagged
# action span, `agent/spans.py`); the learner multiplies the distillation mask by it
DISTILL_SPAN = "distill/span_mask"


@dataclass(frozen=True)
class SampleMarks:
    """What the rollout did to a sample after generating it, typed (never string keys of `info`,
    which holds what its reward function said and is set anew by every scoring). Frozen: a step
    that marks a sample replaces its marks (`dataclasses.replace`), so copies never share them."""

    regenerations: int = 0  # times its group was generated again, its first try too stale
    rescued: bool = False  # put back from an earlier step by a group repair: old by design (`Recipe.stale_ok`)
    substituted_from: int | None = None  # a copy of a sample of this group, standing in for one of its own
    corrected_by: str | None = None  # the error-correction op that rewrote it ("reflect", "inject", "reference")
    branch_of: int | None = None  # a tree rollout's branch (APPO): the index in its group of the root it continues

    # the `info` keys older checkpoints kept these in: key -> field (read once by `restore`)
    LEGACY_INFO_KEYS: ClassVar[dict[str, str]] = {
        "regenerations": "regenerations",
        "polaris_rescued": "rescued",
        "polaris_substituted_from": "substituted_from",
        "gec": "corrected_by",
    }

    @classmethod
    def restore(cls, saved: dict[str, Any] | None, info: dict[str, Any]) -> SampleMarks:
        """The marks of a sample saved by a checkpoint: its `marks`, or those an older one left in
        `info` (taken out of it)."""
        if saved is not None:
            return cls(**saved)
        legacy = {f: info.pop(k) for k, f in cls.LEGACY_INFO_KEYS.items() if k in info}
        return cls(**legacy)


@dataclass
class Sample:
    """One completion of one prompt, with everything the learner needs to know about its origin."""

    prompt: Prompt
    group: int  # samples of one prompt share a group id (the prompt's stream index)
    response_ids: list[int]
    rollout_logp: list[float]  # μ: the engine's log-prob of each response token
    policy_version: int  # the weight version the engine generated it with (the oldest, if several)
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""  # decoded completion (stop token trimmed)
    engine: str = ""  # which engine (URL or "embedded:i")
    reward: float = 0.0  # the scalar the advantage uses (the domain's weighted sum of its reward heads)
    reward_error: str | None = None
    reward_heads: dict[str, float] = field(default_factory=dict)  # each named reward of the domain, unweighted
    info: dict[str, Any] = field(default_factory=dict)
    # weight version of each response token (partial rollouts continue a sample across syncs);
    # None = all tokens from `policy_version`
    token_versions: list[int] | None = None
    teacher: TeacherScores | None = None  # on-policy distillation: the teacher's view of the response
    # routing replay (R3): the engine's experts per token, a torch int tensor [len(prompt_ids) +
    # len(response_ids) - 1, num_layers, topk] (SGLang's routed_experts; -1 = dense layer), see
    # `compact_routing`; None = not asked for / not returned
    routed_experts: Any = None
    # sampling-mask replay (rollout.sampling_mask_replay): the support each response token was drawn
    # from, flat — `sampling_mask_counts[j]` ids per token j, `sampling_mask_ids` all of them in token
    # order (one flat list, not a list per token: no per-token objects, one tensor conversion);
    # rollout_logp is then the log-prob under the renormalised distribution. None = full vocabulary.
    sampling_mask_ids: list[int] | None = None
    sampling_mask_counts: list[int] | None = None
    # which model generated it: "policy" (the engines of the trained weights) or "explorer" (S2L-PO's
    # frozen smaller model, `rollout.explorer`: μ is then that model's log-probs, off-policy for π)
    source: str = "policy"
    # multi-turn episodes (`mcore_rl.agent`): per response token, 1 where the learner trains (the
    # model's own tokens), 0 on tokens the environment, the tools or the template wrote; None = all 1
    trainable: list[int] | None = None
    episode: int | None = None  # which of its group's episodes it comes from (None: not an episode)
    step_index: int | None = None  # its position in the episode (a step-wise sample's step, a split's segment)
    marks: SampleMarks = field(default_factory=SampleMarks)  # what the rollout's repairs did to it

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    def provenance(self) -> dict[str, Any]:
        return {
            "prompt_index": self.prompt.index,
            "domain": self.prompt.domain,
            "policy_version": self.policy_version,
            "engine": self.engine,
            "finish_reason": self.finish_reason,
            "source": self.source,
        }


def compact_routing(routed: Any) -> Any:
    """An engine's routed experts (numpy / torch ints [tokens - 1, layers, k]) as the torch tensor a
    `Sample` keeps: int16 while the expert ids fit (any real MoE), else int32; None stays None. A
    tensor, not a numpy array, so that checkpoints of the rollout buffer load with torch's safe
    loader."""
    if routed is None:
        return None
    import torch

    t = torch.as_tensor(routed)
    if t.dim() != 3:
        raise ValueError(f"routed_experts: expected [tokens - 1, layers, topk], got shape {tuple(t.shape)}")
    small = t.numel() == 0 or int(t.max()) < 2**15
    return t.to(torch.int16 if small else torch.int32).clone()
