"""APPO's prefix reuse on a real engine: how much of the branches' contexts vLLM serves from its prefix cache.

    bash tools/setup_vllm.sh                      # the vLLM venv (once)
    python benchmarks/appo_prefix_reuse.py        # the tool demo, GRPO and APPO, 3 rollout steps each

A branch at token p of a root's turn continues `the step's prompt + root[:p]`, all of which the root's
own request computed; an engine with a prefix cache (vLLM's automatic prefix caching, SGLang's radix
cache) serves those tokens from the root's K/V instead of prefilling them again. The APPO recipe counts
what such an engine could serve (`rollout/repair/appo_prefix_tokens` of `appo_context_tokens`); this
script measures what one does:

1. One SFT warm start of `configs/agentic_tool_demo.yaml` (the model with head dim 32, which vLLM's CPU
   attention needs), saved as a checkpoint.
2. For each arm (GRPO: G = 8 episodes a prompt; APPO: N = 2 roots, B = 3 branch points, M = 8), a fresh
   vLLM server (`--enable-prefix-caching`, `--block-size`), `mcore-rl train` from the warm start against
   it (`rollout.engine_urls`) for `--steps` rollout steps, then the server's `/metrics`: the prompt tokens
   it looked up in its prefix cache and the ones it found (`vllm:prefix_cache_queries`, `..._hits`).

Both arms play the same prompts with the same episodes per prompt, so the difference in cache hits is
what the branches add; the table puts it beside the recipe's own count. vLLM caches whole blocks only,
so a context shorter than a block, or the part of one past its last full block, is never a hit.
Figures: docs/step_credit.md (APPO, prefix reuse), docs/appo_prefix_reuse.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from mcore_rl.config import RLConfig, load_config  # noqa: E402  (after the sys.path entry above)
from mcore_rl.observe.sinks import read_metrics  # noqa: E402
from mcore_rl.rollout.vllm_processes import VLLMEngineProcesses  # noqa: E402

RECIPE = "configs/agentic_tool_demo.yaml"
MODEL = ["model.kv_channels=32"]  # vLLM's CPU attention takes head dims of 32 and up
VLLM = ["rollout.engine_kind=vllm", "rollout.quantization=none", "rollout.sync_transport=disk"]
ARMS = {
    "grpo": [],
    "appo": [
        "rollout.group_size=2",
        "rollout.appo.enabled=true",
        "algorithm.advantage=appo",
        "algorithm.policy_loss=appo",
    ],
}
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false"]


def prefix_counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens) from its Prometheus `/metrics`, summed over label sets."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:prefix_cache_(?:queries|hits))(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def train(argv: list[str], log: str) -> None:
    with open(log, "w") as f:
        rc = subprocess.call(
            [sys.executable, "-m", "mcore_rl.cli", "train", RECIPE, *argv], stdout=f, stderr=f, cwd=HERE
        )
    if rc != 0:
        raise SystemExit(f"mcore-rl train failed ({rc}), see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="rollout steps per arm")
    ap.add_argument("--sft-steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--block-size", type=int, default=32, help="vLLM's KV block, the cache's unit (CPU: a multiple of 32)"
    )
    ap.add_argument("--vllm-args", nargs="*", default=[], help="more flags for the vLLM servers")
    ap.add_argument("--work", default="runs/appo_prefix_reuse")
    ap.add_argument("--out", default=None, help="write the figures to this json")
    args = ap.parse_args()
    work = os.path.join(HERE, args.work)
    os.makedirs(work, exist_ok=True)
    warm = os.path.join(work, "warm")
    if not os.path.exists(os.path.join(warm, "latest")):
        print(f"warm start ({args.sft_steps} SFT steps) ...", flush=True)
        train(
            [
                *MODEL,
                f"run_dir={work}/warm_run",
                f"init.sft_steps={args.sft_steps}",
                "train.num_steps=0",
                "eval.at_start=false",
                f"checkpoint.save_dir={warm}",
                *QUIET,
            ],
            os.path.join(work, "warm.log"),
        )
    cfg = load_config(RLConfig, os.path.join(HERE, RECIPE), MODEL)
    figures: dict[str, dict[str, float]] = {}
    for arm, overrides in ARMS.items():
        print(f"{arm}: vLLM server ...", flush=True)
        engines = VLLMEngineProcesses.start_vllm(
            cfg.model,
            num=1,
            workdir=os.path.join(work, f"{arm}_engine"),
            context_length=cfg.model.max_position_embeddings,
            seed=args.seed,
            extra_args=["--enable-prefix-caching", "--block-size", str(args.block_size), *args.vllm_args],
            startup_timeout_s=900.0,
        )
        try:
            url = engines.urls[0]
            before = prefix_counters(url)
            start = time.perf_counter()
            run_dir = os.path.join(work, arm)
            train(
                [
                    *MODEL,
                    *VLLM,
                    *overrides,
                    f"rollout.engine_urls=[{url}]",
                    f"rollout.sync_dir={work}/{arm}_weights",
                    f"run_dir={run_dir}",
                    f"train.seed={args.seed}",
                    "init.sft_steps=0",
                    f"init.checkpoint={warm}",
                    f"train.num_steps={args.steps}",
                    "eval.at_start=false",
                    "eval.interval=0",
                    *QUIET,
                ],
                os.path.join(work, f"{arm}.log"),
            )
            after = prefix_counters(url)
        finally:
            engines.close()
        records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        summed = {
            k: sum(float(r[k]) for r in records if k in r)
            for k in ("rollout/repair/appo_prefix_tokens", "rollout/repair/appo_context_tokens", "train/tokens")
        }
        queries = after.get("vllm:prefix_cache_queries", 0.0) - before.get("vllm:prefix_cache_queries", 0.0)
        hits = after.get("vllm:prefix_cache_hits", 0.0) - before.get("vllm:prefix_cache_hits", 0.0)
        figures[arm] = {
            "prompt_tokens_looked_up": queries,
            "prompt_tokens_served_from_cache": hits,
            "hit_rate": hits / queries if queries else float("nan"),
            "wall_s": time.perf_counter() - start,
            **summed,
        }
        print(f"  {json.dumps(figures[arm])}", flush=True)
    print(f"\nvLLM prefix cache over {args.steps} rollout steps (block {args.block_size}), seed {args.seed}")
    print(
        "| arm | prompt tokens looked up | served from the cache | hit rate | APPO's count: branch prefix / context |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for arm, f in figures.items():
        own = (
            f"{f['rollout/repair/appo_prefix_tokens']:.0f} / {f['rollout/repair/appo_context_tokens']:.0f}"
            if f["rollout/repair/appo_context_tokens"]
            else "—"
        )
        print(
            f"| {arm} | {f['prompt_tokens_looked_up']:.0f} | {f['prompt_tokens_served_from_cache']:.0f} "
            f"| {f['hit_rate']:.1%} | {own} |"
        )
    extra = figures["appo"]["prompt_tokens_served_from_cache"] - figures["grpo"]["prompt_tokens_served_from_cache"]
    print(f"APPO's cache hits beyond GRPO's: {extra:.0f} tokens")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {"steps": args.steps, "block_size": args.block_size, "seed": args.seed, "arms": figures}, fh, indent=1
            )


if __name__ == "__main__":
    main()
