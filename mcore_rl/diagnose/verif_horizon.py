"""VerifHorizon — The Verification Horizon: No Silver Bullet for Coding Agent Rewards (Qwen, 2026):
`mcore-rl diagnose verif_horizon`.

The paper's thesis is that verification is harder than generation and gets harder with the horizon: a
reward signal is judged on scalability, faithfulness and robustness, and every existing verifier gets at
most two of the three. Its measurable core for a trainer is how far two reward signals for the same
rollouts agree, and how that agreement decays as the responses get longer. This analysis measures it:
on the same rollouts, two or more verifiers (registered rewards, each turned into a pass/fail verdict
with `--threshold`), the first one being the reference (e.g. the task's exact verifier, against a looser
one such as `formatting`, `math` or a judge), and for every response-length bin (the horizon, in response
tokens): agreement, Cohen's κ, the false-positive rate (the other passes what the reference fails: the
reward-hacking direction) and the false-negative rate.

Choices where the summary gives nothing to copy (the paper reports no such table):

- The horizon of a rollout is its response length in tokens; bins are [0, 1), [1, 2), [2, 4), [4, 8), ...
  (doubling, since horizons span orders of magnitude) unless `--edges` gives them. Empty bins are omitted.
- The verification horizon is the lower edge of the first bin (from short to long) whose κ falls below
  `--kappa-min` (default 0.6, "substantial" agreement), with at least `--min-bin` rollouts; None when no
  bin does. κ is None where it is undefined (both verdicts constant and equal in the bin: p_e = 1).
- Rollouts: runs save none (a run directory holds metrics.jsonl and checkpoints), so they are sampled
  with the embedded engine (`--model`, `--config`, as `vgh`), or read from `--samples`, a jsonl with
  `prompt`, `completion`, `label` and optionally `response_tokens` (else the completion is tokenised).
- A verifier call that fails (raises, times out) scores `reward.error_reward` as in training and is
  counted in `errors`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np

from mcore_rl.diagnose import analysis
import mcore_rl.data.tasks  # noqa: F401  (registers the tasks' rewards)
from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, get_reward_fn

# ---------------------------------------------------------------- the statistics


def agreement(reference: Sequence[bool] | np.ndarray, other: Sequence[bool] | np.ndarray) -> dict[str, Any]:
    """Agreement of two pass/fail verdicts on the same rollouts: the fraction that agree, Cohen's
    κ = (p_o − p_e)/(1 − p_e), FPR = P(other passes | reference fails), FNR = P(other fails | reference
    passes). Undefined rates (no rollout to condition on, p_e = 1) are None."""
    ref, oth = np.asarray(reference, dtype=bool), np.asarray(other, dtype=bool)
    if ref.shape != oth.shape or ref.ndim != 1:
        raise ValueError(f"verdicts must be two flat sequences of one length, got {ref.shape} and {oth.shape}")
    n = int(ref.size)
    if n == 0:
        raise ValueError("no rollouts to compare")
    p_o = float((ref == oth).mean())
    p_ref, p_oth = float(ref.mean()), float(oth.mean())
    p_e = p_ref * p_oth + (1 - p_ref) * (1 - p_oth)
    kappa = None if p_e >= 1.0 else (p_o - p_e) / (1.0 - p_e)
    neg, pos = ~ref, ref
    fpr = float(oth[neg].mean()) if neg.any() else None
    fnr = float((~oth[pos]).mean()) if pos.any() else None
    return {
        "n": n,
        "agreement": p_o,
        "kappa": kappa,
        "fpr": fpr,
        "fnr": fnr,
        "reference_pass": p_ref,
        "other_pass": p_oth,
    }


def doubling_edges(max_length: int) -> list[int]:
    """0, 1, 2, 4, 8, ... up to the first edge above `max_length` (so no rollout is in the open last bin)."""
    edges, e = [0, 1], 1
    while e <= max_length:
        e *= 2
        edges.append(e)
    return edges


def binned(
    lengths: Sequence[int], reference: Sequence[bool], other: Sequence[bool], edges: Sequence[int]
) -> list[dict[str, Any]]:
    """`agreement` within each length bin [edges[i], edges[i+1]) that holds rollouts, and [edges[-1], inf)
    for longer ones; rollouts shorter than edges[0] are in no bin."""
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bin edges must be at least two increasing numbers, got {list(edges)}")
    lengths_a = np.asarray(lengths)
    ref, oth = np.asarray(reference, dtype=bool), np.asarray(other, dtype=bool)
    rows = []
    for lo, hi in zip(edges, list(edges[1:]) + [None]):
        sel = (lengths_a >= lo) & (lengths_a < hi if hi is not None else True)
        if sel.any():
            rows.append(
                {"tokens": f"[{lo},{hi if hi is not None else 'inf'})", "lo": lo, **agreement(ref[sel], oth[sel])}
            )
    return rows


def verification_horizon(rows: Sequence[dict[str, Any]], kappa_min: float, min_bin: int = 1) -> int | None:
    """The lower edge of the first bin (rows in length order) with at least `min_bin` rollouts whose κ is
    below `kappa_min`; None when none is."""
    for row in rows:
        if row["n"] >= min_bin and row["kappa"] is not None and row["kappa"] < kappa_min:
            return int(row["lo"])
    return None


# ---------------------------------------------------------------- rollouts and verifiers


@dataclass
class Rollout:
    prompt: str
    completion: str
    label: Any
    tokens: int
    metadata: dict[str, Any]


def parse_verifier(spec: str) -> tuple[str, dict[str, Any]]:
    """`NAME` or `NAME={"option": value}` (a registered reward or a "package.module:function")."""
    name, sep, options = spec.partition("=")
    if not name:
        raise ValueError(f"--verifier {spec!r}: no reward name")
    if not sep:
        return name, {}
    try:
        parsed = json.loads(options)
    except json.JSONDecodeError as err:
        raise ValueError(f"--verifier {spec!r}: the options are not JSON ({err})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"--verifier {spec!r}: the options must be a JSON object")
    return name, parsed


def labels(verifiers: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """The verifiers' names, a name given more than once (with other options) numbered: name, name#2, ..."""
    seen: dict[str, int] = {}
    out = []
    for name, _ in verifiers:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def read_samples(path: str, tokenizer: Any) -> list[Rollout]:
    """Rollouts of a jsonl file (`prompt`, `completion`, `label`, optional `response_tokens`)."""
    if os.path.isdir(path):
        raise ValueError(
            f"--samples {path!r} is a directory; runs do not save their rollouts (a run directory holds "
            "metrics.jsonl and checkpoints): sample them instead with --model (an HF-format model; "
            "`mcore-rl convert mcore-to-hf` makes one from a checkpoint) and --config, or give a jsonl "
            "file with prompt, completion, label (and optionally response_tokens) per line"
        )
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not JSON ({err})") from None
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("prompt"), str)
                or not isinstance(obj.get("completion"), str)
            ):
                raise ValueError(f"{path}:{lineno}: expected an object with string 'prompt' and 'completion'")
            tokens = obj.get("response_tokens")
            if tokens is None:
                tokens = len(tokenizer.encode(obj["completion"]))
            elif isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise ValueError(f"{path}:{lineno}: 'response_tokens' must be an integer >= 0, got {tokens!r}")
            out.append(Rollout(obj["prompt"], obj["completion"], obj.get("label"), tokens, {}))
    if not out:
        raise ValueError(f"{path}: no rollouts")
    return out


def score(
    rollouts: Sequence[Rollout], name: str, options: dict[str, Any], timeout_s: float, error_reward: float
) -> tuple[list[float], int]:
    """Each rollout's reward from one verifier (in reward worker processes, as training scores), and the
    number of calls that failed."""

    runner = RewardRunner(
        RewardFunction(
            get_reward_fn(name), timeout_s=timeout_s, error_reward=error_reward, name=name, options=dict(options)
        )
    )
    try:
        results = runner.score_sync([RewardInput(r.prompt, r.completion, r.label, dict(r.metadata)) for r in rollouts])
    finally:
        runner.close()
    return [r.reward for r in results], sum(r.error is not None for r in results)


def compare(
    rollouts: Sequence[Rollout],
    verifiers: Sequence[tuple[str, dict[str, Any]]],
    rewards: Sequence[list[float]],
    errors: Sequence[int],
    threshold: float,
    edges: Sequence[int] | None,
    kappa_min: float,
    min_bin: int,
) -> dict[str, Any]:
    """The tables: overall and per length bin, every verifier against the first."""
    lengths = [r.tokens for r in rollouts]
    edges = list(edges) if edges else doubling_edges(max(lengths))
    verdicts = [[x >= threshold for x in rs] for rs in rewards]
    names = labels(verifiers)
    ref_name = names[0]
    out: dict[str, Any] = {
        "rollouts": len(rollouts),
        "threshold": threshold,
        "reference": ref_name,
        "mean_response_tokens": float(np.mean(lengths)),
        "verifiers": [
            {"verifier": n, "options": json.dumps(o, sort_keys=True), "pass_rate": float(np.mean(v)), "errors": e}
            for n, (_, o), v, e in zip(names, verifiers, verdicts, errors)
        ],
    }
    for name, v in zip(names[1:], verdicts[1:]):
        rows = binned(lengths, verdicts[0], v, edges)
        key = f"{name}_vs_{ref_name}"
        out[key] = {
            "overall": agreement(verdicts[0], v),
            "by_length": rows,
            "verification_horizon_tokens": verification_horizon(rows, kappa_min, min_bin),
            "kappa_min": kappa_min,
        }
    return out


@analysis(
    "verif_horizon",
    "VerifHorizon: agreement (Cohen's kappa, FPR/FNR) of two or more verifiers "
    "on the same rollouts, by response length",
)
def add_arguments(parser: argparse.ArgumentParser):
    from mcore_rl.diagnose.rollouts import add_policy_arguments  # lazy: torch

    add_policy_arguments(parser, default_prompts=32, default_group=4)
    parser.add_argument(
        "--verifier",
        action="append",
        required=True,
        help='a reward as NAME or NAME={"option": value}; give two or more, the first is the reference',
    )
    parser.add_argument(
        "--samples",
        default=None,
        help="jsonl of rollouts (prompt, completion, label, response_tokens) instead of sampling",
    )
    parser.add_argument("--threshold", type=float, default=1.0, help="a verifier passes a rollout at reward >= this")
    parser.add_argument("--edges", default=None, help="length bin edges in tokens, e.g. 0,4,16,64 (default: doubling)")
    parser.add_argument("--kappa-min", type=float, default=0.6, help="κ below this ends the verification horizon")
    parser.add_argument("--min-bin", type=int, default=8, help="rollouts a bin needs to end the horizon")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        from mcore_rl.diagnose.rollouts import load_policy, load_recipe, sample_groups, take_prompts  # lazy: torch

        verifiers = [parse_verifier(v) for v in args.verifier]
        if len(verifiers) < 2:
            raise ValueError("give two or more --verifier (the first is the reference)")
        edges = None
        if args.edges:
            try:
                edges = [int(x) for x in args.edges.split(",")]
            except ValueError:
                raise ValueError(f"--edges {args.edges!r}: expected integers separated by commas") from None
        if args.samples is not None:
            cfg, tokenizer = load_recipe(args)
            rollouts, source = read_samples(args.samples, tokenizer), args.samples
        else:
            policy = load_policy(args)
            cfg = policy.cfg
            prompts = take_prompts(policy, args.prompts, args.split)
            groups = sample_groups(policy, prompts, args.group_size, args.temperature)
            rollouts = [
                Rollout(
                    s.prompt.text,
                    s.text,
                    s.prompt.label,
                    len(s.response_ids),
                    {"finish_reason": s.finish_reason, "domain": s.prompt.domain},
                )
                for g in groups
                for s in g
            ]
            source = policy.source
        rc = cfg.reward
        scored = [score(rollouts, n, o, rc.timeout_s, rc.error_reward) for n, o in verifiers]
        out = {"rollouts_from": source}
        out.update(
            compare(
                rollouts,
                verifiers,
                [s[0] for s in scored],
                [s[1] for s in scored],
                args.threshold,
                edges,
                args.kappa_min,
                args.min_bin,
            )
        )
        return out

    return run
