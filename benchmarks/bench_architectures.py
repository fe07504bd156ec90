"""Training-step time and peak memory of AttnRes, Over-Encoding and LatentMoE vs plain baselines.

Every architecture is timed through the real megatron-core training step (`build_trainer` from
`mcore_rl.train.sft`, then the two halves of `train_step`: `forward_backward` -- megatron-core's
schedule, forward and backward -- and the optimizer step), fp32, against the plain model of the
same width and depth, and printed as ratios:

    .venv/bin/python benchmarks/bench_architectures.py                       # everything (10-12 min on 2 cores)
    .venv/bin/python benchmarks/bench_architectures.py --groups dense moe    # single-rank groups only
    .venv/bin/python benchmarks/bench_architectures.py --rounds 3 --steps 8  # more samples

Size (`BASE`): hidden 256, 8 layers, SwiGLU ffn 1024, 4 heads / 2 KV groups (head dim 64), byte
vocabulary 384, seq 256, micro-batch 4, global batch 8 (2048 tokens per step), the synthetic data
of `configs/sft_demo.yaml` packed into the rows (the content does not matter for time or memory).

Groups (the first variant of each group is its baseline; ratios are variant / baseline):

* `dense` (1 rank): `baseline` (dense Qwen3-style), `attnres_full` (model.attn_res=full: 16
  sublayer sources), `attnres_block8` (model.attn_res=block, N=8 blocks of 2 sublayers, the paper's
  N ~ 8), `oe_m49157` (Over-Encoding, orders [2, 3], 2 slices per order, table size 49157 ~ 128 x
  vocab -- coprime with 384; the tables hold 10.5M params, more than the 8.1M-param body, as in
  the paper's regime where the tables dwarf the model) and `oe_m3079` (the same with m = 3079 ~ 8 x
  vocab: 0.68M table params).
* `moe` (1 rank), the LatentMoE paper's three configurations scaled down from (alpha, N, K) =
  (1, 64, 6) / (4, 256, 6) / (4, 256, 24) to d = 256, expert intermediate m = 256:
  `moe` (alpha 1, N 16, K 2), `latent_eff` (alpha 4 -> latent 64, N' 64, K 2) and `latent_acc`
  (alpha 4, N' 64, K' 8). No shared experts; all 8 layers are MoE; load-balancing aux loss 0.01.
  megatron-core's non-grouped `SequentialMLP` (no TE / grouped GEMM on CPU) runs the experts one
  after another.
* `dense_tp2` (2 ranks, TP=2): `baseline` vs `oe_m49157` with the n-gram tables row-sharded over the
  two TP ranks (each rank looks up the rows it owns; one all-reduce of the partial lookups).
* `dense_dp2` (2 ranks, DP=2): `baseline` vs `oe_m49157` with the tables replicated over DP (their
  gradients all-reduced like every other parameter) vs `oe_m49157_dpshard`
  (model.ngram.shard_over_data_parallel=true: rows sharded over the DP ranks, all-to-all lookups
  -- the paper's recommended layout instead of FSDP).

Time: every group runs in one process (or one torchrun job), its variants stepped alternately with
the order rotated every step, so background load from other processes on a shared machine hits
them alike; groups are round-robined (dense, moe, tp2, dp2, dense, ...) for `--rounds`. Each rank
uses `--threads` intra-op threads (default 1; more threads than free cores make every OpenMP
barrier wait on a descheduled thread). Reported: median and minimum over all timed steps of
(a) fwd+bwd = `forward_backward` (the schedule's forward and backward over the step's micro-batches,
megatron-core DDP grad buffers, loss and token counts) and (b) step = fwd+bwd + the optimizer
step (`ModelParallelAdamW`: grad clipping + Adam over every parameter). For 2-rank jobs every
step starts after a barrier and a step's time is the slowest rank's. Ratios: median / baseline
median, min / baseline min, and "paired": the median over steps of (variant's step i / baseline's
step i), the two having run next to each other -- the most robust of the three when the load of a
shared machine drifts. The load average at the start and the end is printed: on a busy 2-core
machine the 2-rank rows are far noisier than the 1-rank ones (their median can be 2x their min).

Memory: each variant then runs alone in its own process (job for 2 ranks): peak-RSS growth over a
baseline taken after all imports and before `build_trainer` (data rows, model, grad buffers, Adam
state, activations of 1 + 2 steps), summed over ranks, measured as in `benchmarks/bench_sft.py` (whose
helpers it uses; see its docstring for what RSS does and does not capture). "params" is the
number of parameters on rank 0 (for sharded tables: the rank's shard).

Sanity: every variant starts from the same seed and trains on the same batches; the first and last
loss of each are printed (AttnRes' pseudo-queries start at zero and the n-gram tables are extra
inputs, so the step-1 losses differ only through initialisation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/sft_demo.yaml"

BASE = [
    "model.hidden_size=256",
    "model.num_layers=8",
    "model.ffn_hidden_size=1024",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.max_position_embeddings=256",
    "train.seq_length=256",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.eval_interval=0",
    "train.train_iters=1000",
    "data.synthetic_num_examples=8192",
]
OE = ["model.ngram.orders=[2,3]", "model.ngram.num_slices=2"]
MOE = ["model.arch=qwen3_moe", "model.moe_ffn_hidden_size=256", "model.moe_aux_loss_coeff=0.01"]

# group -> (ranks, extra overrides for the whole group, {variant: overrides}); first = baseline
GROUPS: dict[str, tuple[int, list[str], dict[str, list[str]]]] = {
    "dense": (
        1,
        [],
        {
            "baseline": [],
            "attnres_full": ["model.attn_res=full"],
            "attnres_block8": ["model.attn_res=block", "model.attn_res_num_blocks=8"],
            "oe_m49157": OE + ["model.ngram.table_size=49157"],
            "oe_m3079": OE + ["model.ngram.table_size=3079"],
        },
    ),
    "moe": (
        1,
        [],
        {
            "moe": MOE + ["model.num_experts=16", "model.moe_router_topk=2"],
            "latent_eff": MOE + ["model.num_experts=64", "model.moe_router_topk=2", "model.moe_latent_size=64"],
            "latent_acc": MOE + ["model.num_experts=64", "model.moe_router_topk=8", "model.moe_latent_size=64"],
        },
    ),
    "dense_tp2": (
        2,
        ["parallel.tensor_model_parallel_size=2"],
        {
            "baseline": [],
            "oe_m49157": OE + ["model.ngram.table_size=49157"],
        },
    ),
    "dense_dp2": (
        2,
        [],
        {
            "baseline": [],
            "oe_m49157": OE + ["model.ngram.table_size=49157"],
            "oe_m49157_dpshard": OE + ["model.ngram.table_size=49157", "model.ngram.shard_over_data_parallel=true"],
        },
    ),
}
LAYOUT = {"dense": "1 rank", "moe": "1 rank", "dense_tp2": "TP=2", "dense_dp2": "DP=2"}


# --------------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------------


def _cfg(group: str, variant: str, extra: list[str]):
    from mcore_rl.config import SFTConfig, load_config

    _, group_overrides, variants = GROUPS[group]
    cfg = load_config(SFTConfig, os.path.join(REPO, CONFIG), BASE + group_overrides + variants[variant] + extra)
    cfg.checkpoint.load_dir = None  # never resume; nothing is saved
    return cfg


def _timed_step(trainer) -> tuple[float, float, float]:
    """`train_step` split in its two halves: (loss, fwd+bwd seconds, whole-step seconds)."""
    import torch.distributed as dist

    from mcore_rl.train.forward_backward import forward_backward

    for chunk in trainer.chunks:
        chunk.train()
    batch = next(trainer.batches)
    if dist.get_world_size() > 1:
        dist.barrier()  # every rank starts the step together
    t0 = time.perf_counter()
    result = forward_backward(trainer.chunks, batch)
    t1 = time.perf_counter()
    trainer.optimizer.step()
    t2 = time.perf_counter()
    trainer.iteration += 1
    return result["loss"], t1 - t0, t2 - t0


def _num_params(trainer) -> int:
    return sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())


def _max_over_ranks(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank is done
    return t.tolist()


def worker_speed(args) -> dict[str, Any]:
    """All variants of the group in this process, stepped alternately (order rotated every step)."""
    import torch.distributed as dist

    from mcore_rl.parallel import setup
    from mcore_rl.train.sft import build_trainer

    names = list(GROUPS[args.group][2])
    trainers = {}
    for name in names:  # each build re-creates the (identical) parallel state; models keep their groups
        trainers[name] = build_trainer(_cfg(args.group, name, args.overrides))
    fb = {n: [] for n in names}
    step = {n: [] for n in names}
    losses = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            loss, t_fb, t_step = _timed_step(trainers[name])
            losses[name].append(loss)
            if i >= args.warmup:
                fb[name].append(t_fb)
                step[name].append(t_step)
    out = {
        "fb": {n: _max_over_ranks(v) for n, v in fb.items()},
        "step": {n: _max_over_ranks(v) for n, v in step.items()},
        "losses": losses,
        "params": {n: _num_params(t) for n, t in trainers.items()},
    }
    rank = dist.get_rank()
    setup.destroy()
    return out if rank == 0 else {}


def worker_memory(args) -> dict[str, Any]:
    """One variant alone: peak-RSS growth (MiB) over a post-import baseline, summed over ranks."""
    import torch.distributed as dist

    from bench_sft import _imports_for_baseline, _maxrss_kib, _rss_baseline
    from mcore_rl.parallel import setup
    from mcore_rl.train.sft import build_trainer

    _imports_for_baseline()
    cfg = _cfg(args.group, args.variant, args.overrides)
    setup.init_distributed()  # before the baseline: the process group is not the variant's memory
    before = _rss_baseline()
    trainer = build_trainer(cfg)
    for _ in range(args.warmup + args.steps):
        _timed_step(trainer)
    growth = (_maxrss_kib() - before) / 1024
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, growth)
    params = _num_params(trainer)
    rank = dist.get_rank()
    setup.destroy()
    return {"peak_mib": sum(everyone), "peak_mib_per_rank": everyone, "params": params} if rank == 0 else {}


def run_worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_sft's helpers
    result = worker_speed(args) if args.worker == "speed" else worker_memory(args)
    if result:
        result["threads"] = torch.get_num_threads()
        with open(args.result_file, "w") as f:
            json.dump(result, f)


# --------------------------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------------------------


def launch(args, worker: str, group: str, variant: str | None, steps: int, warmup: int) -> dict[str, Any]:
    fd, result_file = tempfile.mkstemp(suffix=".json", prefix="bench_arch_")
    os.close(fd)
    ranks = GROUPS[group][0]
    worker_args = [
        os.path.abspath(__file__),
        "--worker",
        worker,
        "--group",
        group,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--threads",
        str(args.threads),
        "--result-file",
        result_file,
    ]
    if variant:
        worker_args += ["--variant", variant]
    worker_args += list(args.overrides)
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *worker_args]
    else:
        cmd = [sys.executable, *worker_args]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)  # threads are set explicitly (torchrun would force 1)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
            )
        with open(result_file) as f:
            return json.load(f)
    finally:
        os.unlink(result_file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for every variant, e.g. train.seq_length=128")
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--rounds", type=int, default=2, help="round-robin repetitions of the speed jobs")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant and round")
    ap.add_argument("--memory-steps", type=int, default=2, help="steps (after 1 warmup) of each memory run")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-variant memory runs")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", choices=["speed", "memory"], help=argparse.SUPPRESS)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return

    import platform

    print(f"bench_architectures: {' '.join(BASE + list(args.overrides))}")
    print(
        f"{args.rounds} rounds x {args.steps} timed steps (+{args.warmup} warmup) per variant; "
        f"{args.threads} thread(s) per rank; {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    )
    t_start, load0 = time.perf_counter(), os.getloadavg()
    speed: dict[str, list[dict]] = {g: [] for g in args.groups}
    for r in range(args.rounds):
        for g in args.groups:
            t0 = time.perf_counter()
            speed[g].append(launch(args, "speed", g, None, args.steps, args.warmup))
            print(f"  round {r + 1} {g:10s} (speed) {time.perf_counter() - t0:6.1f} s", flush=True)
    memory: dict[tuple[str, str], dict] = {}
    if not args.no_memory:
        for g in args.groups:
            for v in GROUPS[g][2]:
                t0 = time.perf_counter()
                memory[(g, v)] = launch(args, "memory", g, v, args.memory_steps, 1)
                print(f"  {g:10s} {v:18s} (memory) {time.perf_counter() - t0:6.1f} s", flush=True)

    rows = []
    for g in args.groups:
        names = list(GROUPS[g][2])
        for v in names:
            fb = [t for res in speed[g] for t in res["fb"][v]]
            st = [t for res in speed[g] for t in res["step"][v]]
            # paired: step i of the variant over step i of the baseline, which ran right next to it
            fb0 = [t for res in speed[g] for t in res["fb"][names[0]]]
            st0 = [t for res in speed[g] for t in res["step"][names[0]]]
            mem = memory.get((g, v), {})
            rows.append(
                dict(
                    group=g,
                    variant=v,
                    layout=LAYOUT[g],
                    params=speed[g][0]["params"][v],
                    fb_med=statistics.median(fb),
                    fb_min=min(fb),
                    st_med=statistics.median(st),
                    st_min=min(st),
                    peak=mem.get("peak_mib"),
                    n=len(fb),
                    fb_paired=statistics.median(a / b for a, b in zip(fb, fb0)),
                    st_paired=statistics.median(a / b for a, b in zip(st, st0)),
                    fb_all=fb,
                    st_all=st,
                    loss1=speed[g][0]["losses"][v][0],
                    loss_last=speed[g][0]["losses"][v][-1],
                )
            )
    load = os.getloadavg()
    print(
        f"\nresults (wall {time.perf_counter() - t_start:.0f} s; load average at start {load0[0]:.1f}, at end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores)"
    )
    print(
        "times: s per step of 2048 tokens, median (min) over all timed steps; ratios vs the group's first row: "
        "median/median, min/min, and paired = median over steps of variant/baseline of the adjacent steps; "
        "peak MB = peak-RSS growth summed over ranks; params on rank 0"
    )
    header = (
        f"{'group':9s} {'variant':18s} {'layout':6s} {'params':>7s} {'fwd+bwd s':>13s} {'step s':>13s} "
        f"{'peak MB':>7s} | {'fwd+bwd ratio med/min/paired':>28s} | {'step ratio med/min/paired':>25s} | "
        f"{'MB ratio':>8s} | {'loss 1':>6s} {'loss N':>6s}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        base = next(x for x in rows if x["group"] == row["group"])
        peak = f"{row['peak']:7.0f}" if row["peak"] is not None else f"{'-':>7s}"
        mb_ratio = f"{row['peak'] / base['peak']:7.2f}x" if row["peak"] is not None else f"{'-':>8s}"
        fbr = f"{row['fb_med'] / base['fb_med']:.2f} / {row['fb_min'] / base['fb_min']:.2f} / {row['fb_paired']:.2f}"
        str_ = f"{row['st_med'] / base['st_med']:.2f} / {row['st_min'] / base['st_min']:.2f} / {row['st_paired']:.2f}"
        print(
            f"{row['group']:9s} {row['variant']:18s} {row['layout']:6s} {row['params'] / 1e6:6.2f}M "
            f"{row['fb_med']:6.3f} ({row['fb_min']:.3f}) {row['st_med']:6.3f} ({row['st_min']:.3f}) {peak} | "
            f"{fbr:>28s} | {str_:>25s} | {mb_ratio} | {row['loss1']:6.3f} {row['loss_last']:6.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
