"""`rollout.speculative_*` as SGLang's server flags, for the SGLang servers a cluster launch starts.

The embedded engine and `mcore-rl serve` read the same keys (`rollout/pool.py`); engine nodes of a
cluster launch run `python -m sglang.launch_server` where SGLang is installed (`launch/engines.sh`),
and the plan (`parallel/launch_plan.py`) hands them these flags as `ENGINE_SPEC_ARGS`. SGLang's
names (its speculative decoding documentation and `server_args.py`):

| key | SGLang flag |
| --- | --- |
| `speculative_algorithm` ngram / standalone / nextn / eagle / eagle3 | `--speculative-algorithm NGRAM / STANDALONE / NEXTN / EAGLE / EAGLE3` |
| `speculative_num_steps` | `--speculative-num-steps` (draft depth) |
| `speculative_eagle_topk` | `--speculative-eagle-topk` (branching per step; 1 = a chain, the embedded engine's only shape) |
| `speculative_num_draft_tokens` | `--speculative-num-draft-tokens` (tokens verified per pass; default steps + 1 for a chain) |
| `speculative_draft_model_path` | `--speculative-draft-model-path` (EAGLE / EAGLE3 / STANDALONE; NEXTN: optional, the checkpoint's own MTP layers otherwise) |

NEXTN (SGLang turns it into EAGLE over the model's own next-token-prediction layers) loads drafts
for the model families SGLang ships a NextN / MTP draft class for: DeepSeek-V3 / R1 (and V3.1,
V3.2), GLM-4.5 / 4.6, MiMo, Qwen3-Next — the checkpoint's `model.layers.{num_hidden_layers + i}.*`
(DeepSeek, GLM) or its own MTP names. This project's own heads (`model.mtp_num_layers` on a
qwen3 / llama policy, exported as `mtp.layers.{d}.*`) have no SGLang draft class: SGLang cannot
draft with them (they draft in the embedded engine).

Exactness: SGLang's acceptance thresholds (`--speculative-accept-threshold-single` / `-acc`) stay
at their default 1.0, lossless rejection sampling; lowering them would change what is sampled, so
nothing here sets them and `launch/engines.sh` passes only these flags.
"""

from __future__ import annotations

from typing import Any

SGLANG_ALGORITHMS = {
    "ngram": "NGRAM",
    "standalone": "STANDALONE",
    "nextn": "NEXTN",
    "eagle": "EAGLE",
    "eagle3": "EAGLE3",
}
SGLANG_ONLY = ("eagle", "eagle3")  # no EAGLE draft models in the embedded engine
NEEDS_DRAFT_MODEL = ("standalone", "eagle", "eagle3")


def draft_tokens(rollout: Any) -> int:
    """Tokens one SGLang verification pass holds: the key, or a chain's steps + 1."""
    n = rollout.speculative_num_draft_tokens
    return rollout.speculative_num_steps + 1 if n is None else n


def sglang_speculative_flags(rollout: Any) -> list[str]:
    """SGLang's `--speculative-*` flags of `rollout.speculative_*` (none when off)."""
    algo = rollout.speculative_algorithm
    if algo == "none":
        return []
    flags = [
        "--speculative-algorithm",
        SGLANG_ALGORITHMS[algo],
        "--speculative-num-steps",
        str(rollout.speculative_num_steps),
    ]
    if algo != "ngram":
        flags += ["--speculative-eagle-topk", str(rollout.speculative_eagle_topk)]
    flags += ["--speculative-num-draft-tokens", str(draft_tokens(rollout))]
    if rollout.speculative_draft_model_path:
        flags += ["--speculative-draft-model-path", rollout.speculative_draft_model_path]
    return flags


def speculative_shape_errors(rollout: Any) -> list[tuple[str, str]]:
    """(key, message) for a tree shape SGLang refuses: a chain verifies exactly steps + 1 tokens, a
    tree of top-k branches at most k x steps + 1."""
    topk, steps = rollout.speculative_eagle_topk, rollout.speculative_num_steps
    out: list[tuple[str, str]] = []
    if topk < 1:
        out.append(("rollout.speculative_eagle_topk", f"must be >= 1, got {topk}"))
        return out
    n = rollout.speculative_num_draft_tokens
    if n is None:
        return out
    if topk == 1 and n != steps + 1:
        out.append(
            (
                "rollout.speculative_num_draft_tokens",
                f"a chain (speculative_eagle_topk 1) verifies speculative_num_steps + 1 = {steps + 1} tokens, got {n}",
            )
        )
    elif not 2 <= n <= topk * steps + 1:
        out.append(
            (
                "rollout.speculative_num_draft_tokens",
                f"must be in [2, speculative_eagle_topk x speculative_num_steps + 1 = {topk * steps + 1}], got {n}",
            )
        )
    return out
