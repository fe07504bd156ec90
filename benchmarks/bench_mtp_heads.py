"""MTP draft heads trained with Bebop's TV loss vs cross-entropy: acceptance in the embedded engine.

For each seed and loss (alternating): the demo recipe's policy (`configs/demo.yaml`) with
`model.mtp_num_layers` heads goes through the SFT warm start (`init.sft`, the heads' loss
`init.sft.train.mtp_loss`), is exported by HF name into an embedded engine with NEXTN speculative
decoding, and answers held-out addition problems at several temperatures (RL samples at 1.0; the
temperature moves the policy's entropy, the quantity Bebop's claim is about). Reported: the
acceptance rate of drafted tokens, tokens per verification pass (accepted + the residual's or
bonus token; a 4-token answer caps it), and the SFT-time expected accepted length on the training
tokens (`mtp_accept_len`). Medians over seeds with the min-max in brackets.

    python benchmarks/bench_mtp_heads.py --seeds 3 --sft-steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trained_engine_stats(args: argparse.Namespace, loss: str, seed: int) -> dict[str, float]:
    """Warm start one policy with heads, then serve the held-out problems at each temperature."""

    from mcore_rl.config import RLConfig, load_config, validate_rl_config
    from mcore_rl.data.tasks.addition import make_addition_examples
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.hf.weight_map import full_megatron_to_hf
    from mcore_rl.models.shards import gather_full_state_dict
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings
    from mcore_rl.train.policy import build_policy
    from mcore_rl.train.warm_start import sft_warm_start

    cfg = load_config(
        RLConfig,
        "configs/demo.yaml",
        [
            f"model.mtp_num_layers={args.depths}",
            f"init.sft.train.mtp_loss={loss}",
            # the demo spells the steps init.sft_steps; naming any init.sft.train key rebuilds that
            # section from TrainConfig's defaults, so the warm start's own ones are restated here
            "init.sft_steps=null",
            f"init.sft.train.train_iters={args.sft_steps}",
            "init.sft.train.micro_batch_size=8",
            "init.sft.train.global_batch_size=8",
            f"train.seed={seed}",
        ],
    )
    policy = build_policy(cfg, validate_rl_config, 1)
    problems = make_addition_examples(args.problems, 10_000 + seed, cfg.data.synthetic_max_digits)
    exclude = {p["prompt"] for p in problems}
    metrics = sft_warm_start(cfg, policy.chunks, policy.tokenizer, 1, lambda _m: None, exclude)
    state = full_megatron_to_hf(gather_full_state_dict(policy.chunks), cfg.model)
    model = McoreRLForCausalLM(hf_config_from_model_config(cfg.model))
    model.load_state_dict(state, strict=not cfg.model.tie_word_embeddings)
    out = {"sft_accept_len": metrics.get("init/sft_mtp_accept_len", float("nan"))}
    for temperature in args.temperatures:
        engine = EngineCore(
            model,
            policy.tokenizer,
            max_running_requests=64,
            context_length=64,
            speculative=SpeculativeSettings("NEXTN", args.steps),
        )
        sp = dict(temperature=temperature, max_new_tokens=cfg.rollout.max_new_tokens)
        reqs = [
            Request(f"p{i}", policy.tokenizer.encode(ex["prompt"]), SamplingParams(**sp, seed=i))
            for i, ex in enumerate(problems)
        ]
        for r in reqs:
            engine.add_request(r)
        while engine.has_work():
            engine.step()
        s = engine.spec_stats
        out[f"accept@{temperature}"] = s["accepted"] / max(s["drafted"], 1)
        out[f"tok/fwd@{temperature}"] = s["emitted"] / max(s["rows_verified"], 1)
    return out


def run_one(args: argparse.Namespace, loss: str, seed: int) -> dict[str, float]:
    """One (loss, seed) in its own process: megatron-core's parallel state is per process."""
    argv = [sys.executable, os.path.abspath(__file__), "--one", loss, str(seed), "--sft-steps", str(args.sft_steps)]
    argv += ["--depths", str(args.depths), "--steps", str(args.steps), "--problems", str(args.problems)]
    argv += ["--threads", str(args.threads), "--temperatures", *map(str, args.temperatures)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{loss} seed {seed} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--depths", type=int, default=2, help="model.mtp_num_layers")
    p.add_argument("--steps", type=int, default=3, help="drafted tokens per verification")
    p.add_argument("--problems", type=int, default=200)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.5])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--one", nargs=2, metavar=("LOSS", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(trained_engine_stats(args, args.one[0], int(args.one[1]))))
        return
    results: dict[str, list[dict[str, float]]] = {"tv": [], "ce": []}
    start = time.perf_counter()
    for i in range(args.seeds):
        for loss in ("tv", "ce") if i % 2 == 0 else ("ce", "tv"):  # alternate the order per seed
            r = run_one(args, loss, 1234 + i)
            results[loss].append(r)
            print(f"seed {1234 + i} {loss}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    print(
        f"\n{args.seeds} seeds, {args.sft_steps} SFT steps, {args.depths} MTP depths, {args.steps} drafts per "
        f"verification, {args.problems} problems; {time.perf_counter() - start:.0f} s"
    )
    keys = list(results["tv"][0])
    print(f"{'':16}" + "".join(f"{k:>26}" for k in keys))
    for loss, rows in results.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in rows]
            cells.append(f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})")
        print(f"{loss:16}" + "".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    main()
