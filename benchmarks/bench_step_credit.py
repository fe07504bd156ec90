"""Step-level credit against trajectory-level GRPO on a shipped environment, from one warm start.

    python benchmarks/bench_step_credit.py                                   # guess: 4 estimators x 3 seeds
    python benchmarks/bench_step_credit.py --arms grpo gigpo --seeds 1 &     # split it: one process per part
    python benchmarks/bench_step_credit.py --arms sdar                       # SDAR (privileged context) vs grpo
    python benchmarks/bench_step_credit.py --arms steppo                     # StepPO (a critic) vs grpo
    python benchmarks/bench_step_credit.py --arms appo                       # APPO's tree rollouts vs grpo
    python benchmarks/bench_step_credit.py --arms stepopsd                   # StepOPSD's stale hindsight teacher
    python benchmarks/bench_step_credit.py --report-only                     # the table from what is done

1. One SFT warm start per environment (seed `--warm-seed`), saved as a checkpoint; every arm and seed
   starts from it, so the arms differ only in what RL does.
2. For each seed and arm: `mcore-rl train RECIPE init.sft_steps=0 init.checkpoint=WORK/ENV/warm <the arm's
   overrides> train.seed=SEED train.num_steps=STEPS`, one held-out evaluation at the end (avg@k over k
   sampled games per held-out prompt, and greedy). The seed fixes the prompt order, the held-out games
   and the sampling seeds, so the arms of one seed see the same prompts until their weights diverge.
   The arms run the same number of rollout steps (the same prompts and episodes); the tokens each
   generated and trained on are reported per arm (`train/tokens`, summed), since a policy that solves
   games sooner plays fewer turns.
3. Each finished run writes WORK/ENV/ARM_sSEED.json and is skipped when that file exists (or when its
   metrics end with the final evaluation: a run whose driver was stopped), so the grid can be split
   over processes (give each its own arms or seeds) and resumed; the summary (per arm: mean and min-max over seeds, paired
   difference to GRPO) is printed and written to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from mcore_rl.observe.sinks import read_metrics  # noqa: E402  (after the sys.path entry above)

# the environments: a recipe and its domain name (the metrics' `eval/<domain>/...`)
ENVS: dict[str, dict[str, Any]] = {
    "guess": {"recipe": "configs/agentic_demo.yaml", "overrides": []},
    # the tool task: the calculator on 2-digit arithmetic, two steps an episode (the call, the answer); every arm
    # keeps the recipe's rows of 256 (after the arms' own seq_length, so the rollouts' token caps are the same)
    "tool": {
        "recipe": "configs/agentic_tool_demo.yaml",
        "overrides": ["train.seq_length=256"],
        # StepOPSD's teacher reads a peer's whole episode (the ~80-token call, the answer) before the step's prompt:
        # rows of 512, and positions to match (RoPE: no weight depends on them; a sample of this task is at most
        # ~200 tokens, so the rollouts' token cap does not bind at 256 or 512)
        "arm_overrides": {
            a: ["train.seq_length=512", "model.max_position_embeddings=512"] for a in ("stepopsd", "stepopsd_shuffled")
        },
    },
}

# the teacher: the policy itself with "Reference solution: The secret number is N." (the default template) before
# each step's prompt
PRIVILEGED = "teachers=[{kind: privileged, context: info, context_key: privileged/solution}]"
HINDSIGHT = "teachers=[{kind: privileged, context: info, context_key: privileged/outcome}]"
# each arm: the dotted overrides that turn it on; everything else (the PPO-clip loss, lr, ...) is the recipe's
ARMS: dict[str, list[str]] = {
    "grpo": [],
    "gigpo": ["algorithm.advantage=gigpo"],  # step_weight 1, gamma 0.95
    "hgpo": ["algorithm.advantage=hgpo"],  # levels 4, alpha 1, gamma 0.95, episode_weight 0
    "gagpo": ["algorithm.advantage=gagpo"],  # gamma 0.95, lam 0.8
    # StepPO: its critic (the warm start's weights under a fresh value head, the policy's lr) read at each
    # step's last state token; gamma 0.99, lam 0.95; the step-level ratio; one rollout step of the critic alone
    "steppo": ["algorithm.advantage=steppo", "algorithm.policy_loss=gspo", "algorithm.critic.warmup_steps=1"],
    # GRPO + SDAR's (or SEED's) gated self-distillation towards the privileged teacher, the paper's lambda 0.01
    # (the hint makes a step's prompt ~45 byte tokens longer: rows of 128, not the recipe's 96)
    "sdar": [PRIVILEGED, "distill.losses=[{name: sdar}]", "train.seq_length=128"],
    # SEED's loss is SDAR's gap-gated term; what differs is the teacher's context: the hindsight lesson of the
    # episode (the environment's `privileged/outcome`, "Solved: N on guess k." / "Not solved ...: the secret was N.")
    # where SEED's analyzer would write a skill, not the solution given up front
    "seed": [HINDSIGHT, "distill.losses=[{name: seed}]", "train.seq_length=128"],
    # StepOPSD: GRPO's advantages re-weighted (sign kept) by a stale self-teacher (the policy of up to 10 rollout
    # steps ago) shown the first successful other episode of the group; the paper's alpha 0.2, lambda 0.2 -> 0 at
    # step 50, per-step rescaling (the peer's turns make a prompt up to ~150 byte tokens longer: rows of 256)
    "stepopsd": [
        "teachers=[{kind: privileged, context: peer_episode, refresh_interval: 10}]",
        "distill.losses=[{name: stepopsd}]",
        "train.seq_length=256",
    ],
    # its control arm: the same sizes of re-weighting, dealt to the batch's tokens in a random order (not the
    # teacher's), to separate the teacher's direction from a perturbation of the same size
    "stepopsd_shuffled": [
        "teachers=[{kind: privileged, context: peer_episode, refresh_interval: 10}]",
        "distill.losses=[{name: stepopsd, options: {weights: shuffled}}]",
        "train.seq_length=256",
    ],
    # APPO: N = 2 root episodes per prompt, B = 3 branch points each, one branch per point: M = 8 episodes a
    # prompt, the other arms' G; the dual-group advantage and the (1 + b·Â^ftu)-scaled clip loss
    "appo": [
        "rollout.group_size=2",
        "rollout.appo.enabled=true",
        "algorithm.advantage=appo",
        "algorithm.policy_loss=appo",
    ],
    # APPO's trees with the plain PPO-clip loss (no (1 + b·Â^ftu) factor): which of the two a result comes from
    "appo_clip": ["rollout.group_size=2", "rollout.appo.enabled=true", "algorithm.advantage=appo"],
    # no RL: the warm start evaluated on this seed's held-out games (they depend on train.seed)
    "warm": ["train.num_steps=0", "eval.at_start=true"],
}


def run(cmd: list[str], log: str) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE)
    if rc != 0:
        raise SystemExit(f"command failed ({rc}), see {log}: {' '.join(cmd)}")
    return time.perf_counter() - start


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if finite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def per_step(records: list[dict], key: str) -> list[float]:
    """One value per rollout step (its last record that has the key)."""
    by_step: dict[int, float] = {}
    for r in records:
        if finite(r.get(key)) and "rl_step" in r:
            by_step[int(r["rl_step"])] = float(r[key])
    return [by_step[s] for s in sorted(by_step)]


def last_eval(records: list[dict], k: int) -> dict[str, float]:
    evals = [r for r in records if finite(r.get(f"eval/avg@{k}"))]
    if not evals:
        return {}
    r = evals[-1]
    return {"step": r.get("rl_step"), "avgk": r[f"eval/avg@{k}"], "greedy": r.get("eval/greedy_pass@1")}


def summarize_run(records: list[dict], k: int) -> dict[str, Any]:
    returns = per_step(records, "episode/return_mean")
    return {
        **last_eval(records, k),
        # response tokens the learner trained on (every valid sample's generated tokens), all optimizer steps
        "train_tokens": sum(float(r["train/tokens"]) for r in records if finite(r.get("train/tokens"))),
        "return_first5": mean(returns[:5]),
        "return_last5": mean(returns[-5:]),
        "adv_abs_mean": mean(per_step(records, "advantage/abs_mean")),
        "episode_turns_mean": mean(per_step(records, "episode/turns_mean")),
        # a distillation arm's share of samples its teacher scored (a teacher prompt longer than the row scores
        # nothing, and the arm is GRPO in disguise); NaN for the arms without one
        "distill_scored_frac": mean(per_step(records, "distill/scored_frac")),
    }


def adopt(work: str, arm: str, seed: int, steps: int, k: int) -> bool:
    """True when the run is done: its json exists, or its metrics end with the evaluation at `steps` (a run
    whose driver died, summarized now; its wall from the driver's start stamp to the log's last write)."""
    result = os.path.join(work, f"{arm}_s{seed}.json")
    if os.path.exists(result):
        return True
    metrics = os.path.join(work, f"{arm}_s{seed}", "metrics.jsonl")
    if not os.path.exists(metrics):
        return False
    summary = summarize_run(read_metrics(metrics), k)
    if summary.get("step") != (0 if arm == "warm" else steps):
        return False
    wall = float("nan")
    stamp, log = os.path.join(work, f"{arm}_s{seed}.start"), os.path.join(work, f"{arm}_s{seed}.log")
    if os.path.exists(stamp) and os.path.exists(log):
        with open(stamp) as f:
            wall = os.path.getmtime(log) - float(f.read())
    with open(result, "w") as f:
        json.dump({"arm": arm, "seed": seed, "steps": steps, "wall_s": wall, **summary}, f, indent=1)
    return True


def clean(x: Any) -> Any:
    """NaN (a run with nothing of that kind, e.g. the warm arm's returns) as null: strict JSON."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def spread(values: list[float], pct: bool = True, sign: bool = False) -> str:
    vs = [v for v in values if finite(v)]
    if not vs:
        return "—"
    form = "+.1f" if sign else ".1f"
    f = (lambda v: f"{100 * v:{form}}") if pct else (lambda v: f"{v:,.2f}" if abs(v) < 10 else f"{v:,.0f}")
    return f"{f(mean(vs))} ({f(min(vs))} to {f(max(vs))})" if len(vs) > 1 else f(vs[0])


def report(env: str, work: str, arms: list[str], seeds: list[int], steps: int, k: int, out: str | None) -> None:
    done: dict[str, dict[int, dict]] = {}
    for arm in arms:
        for seed in seeds:
            adopt(work, arm, seed, steps, k)
            path = os.path.join(work, f"{arm}_s{seed}.json")
            if os.path.exists(path):
                with open(path) as f:
                    done.setdefault(arm, {})[seed] = json.load(f)
    warm_path = os.path.join(work, "warm.json")
    warm: dict[str, Any] = {}
    if os.path.exists(warm_path):
        with open(warm_path) as f:
            warm = json.load(f)
    base = done.get("grpo", {})
    print(f"\n{env}: held-out avg@k and greedy pass@1 (%) after RL, mean (min to max) over seeds; Δ paired by seed")
    print(
        "| arm | seeds | avg@k | Δ avg@k vs grpo | greedy | Δ greedy vs grpo | tokens trained | "
        "sampled return, first 5 → last 5 steps | mean abs advantage | wall s |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    if warm:
        print(
            f"| warm start, seed {warm['seed']}'s games | — | {spread([warm['avgk']])} | | {spread([warm['greedy']])} "
            f"| | | | | {warm['wall_s']:.0f} |"
        )
    rows = []
    for arm, by_seed in done.items():
        row: dict[str, Any] = {"arm": arm, "overrides": ARMS.get(arm, []), "seeds": sorted(by_seed)}
        for key in ("avgk", "greedy", "train_tokens", "wall_s", "return_first5", "return_last5", "adv_abs_mean"):
            row[key] = [by_seed[s].get(key) for s in sorted(by_seed)]
        for key in ("avgk", "greedy"):
            row[f"{key}_diff"] = [by_seed[s][key] - base[s][key] for s in sorted(by_seed) if s in base]
        rows.append(row)

        def diff(key: str, row: dict[str, Any] = row) -> str:
            return "—" if arm == "grpo" else spread(row[f"{key}_diff"], sign=True)

        print(
            f"| {arm} | {len(by_seed)} | {spread(row['avgk'])} | {diff('avgk')} | {spread(row['greedy'])} | "
            f"{diff('greedy')} | {spread(row['train_tokens'], pct=False)} | "
            f"{mean(row['return_first5']):.3f} → {mean(row['return_last5']):.3f} | "
            f"{spread(row['adv_abs_mean'], pct=False)} | {spread(row['wall_s'], pct=False)} |"
        )
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(clean({"env": env, "warm": warm, "rows": rows, "runs": done}), f, indent=1)
        print(f"\n{out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="guess", choices=list(ENVS))
    parser.add_argument("--arms", nargs="+", default=["grpo", "gigpo", "hgpo", "gagpo"], choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=15, help="RL rollout steps per run")
    parser.add_argument("--sft-steps", type=int, default=150, help="SFT steps of the shared warm start")
    parser.add_argument("--warm-seed", type=int, default=1234)
    parser.add_argument("--k", type=int, default=4, help="the recipe's eval.k (sampled games per held-out prompt)")
    parser.add_argument("--work", default="runs/bench_step_credit", help="run directories go under WORK/ENV")
    parser.add_argument("--out", default=None, help="write the summary json here")
    parser.add_argument("--report-only", action="store_true", help="print the table from the finished runs")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run (after --)")
    args = parser.parse_args()

    env = ENVS[args.env]
    work = os.path.join(HERE, args.work, args.env)
    os.makedirs(work, exist_ok=True)
    report_arms = list(dict.fromkeys(["grpo", *args.arms]))
    if args.report_only:
        report(args.env, work, report_arms, args.seeds, args.steps, args.k, args.out)
        return

    cli = [sys.executable, "-m", "mcore_rl.cli", "train", env["recipe"]]
    common = [
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        *env["overrides"],
        *args.overrides,
    ]
    warm_ckpt = os.path.join(work, "warm")
    warm_json = os.path.join(work, "warm.json")
    if not os.path.exists(warm_json):
        print(f"{args.env}: warm start ({args.sft_steps} SFT steps) ...", flush=True)
        wall = run(
            cli
            + [
                f"run_dir={work}/warm_run",
                f"train.seed={args.warm_seed}",
                f"init.sft_steps={args.sft_steps}",
                "train.num_steps=0",
                "eval.at_start=true",
                f"checkpoint.save_dir={warm_ckpt}",
                *common,
            ],
            os.path.join(work, "warm.log"),
        )
        summary = last_eval(read_metrics(os.path.join(work, "warm_run", "metrics.jsonl")), args.k)
        with open(warm_json, "w") as f:
            json.dump({**summary, "wall_s": wall, "sft_steps": args.sft_steps, "seed": args.warm_seed}, f, indent=1)

    for seed in args.seeds:
        order = args.arms if seed % 2 == 1 else args.arms[::-1]  # alternate the order between seeds
        for arm in order:
            if adopt(work, arm, seed, args.steps, args.k):
                continue
            run_dir = os.path.join(work, f"{arm}_s{seed}")
            print(f"{args.env}: {arm} seed {seed} ...", flush=True)
            with open(os.path.join(work, f"{arm}_s{seed}.start"), "w") as f:
                f.write(f"{time.time()}\n")
            wall = run(
                cli
                + [
                    f"run_dir={run_dir}",
                    "init.sft_steps=0",
                    f"init.checkpoint={warm_ckpt}",
                    "eval.at_start=false",
                    f"eval.interval={args.steps}",
                    f"train.seed={seed}",
                    f"train.num_steps={args.steps}",
                    *ARMS[arm],
                    *common,
                    *env.get("arm_overrides", {}).get(arm, []),
                ],
                os.path.join(work, f"{arm}_s{seed}.log"),
            )
            summary = summarize_run(read_metrics(os.path.join(run_dir, "metrics.jsonl")), args.k)
            with open(os.path.join(work, f"{arm}_s{seed}.json"), "w") as f:
                json.dump({"arm": arm, "seed": seed, "steps": args.steps, "wall_s": wall, **summary}, f, indent=1)
            print(f"  {json.dumps(summary)} wall {wall:.0f} s", flush=True)
    report(args.env, work, report_arms, args.seeds, args.steps, args.k, args.out)


if __name__ == "__main__":
    main()
