"""SFT step throughput and peak memory: the megatron-core model vs the pure-torch reference model.

Same config, same initial weights, same data batches, same optimizer wrapper; printed as ratios.

    .venv/bin/python benchmarks/bench_sft.py                      # demo + big size, TP=2 row for big (~2 min)
    .venv/bin/python benchmarks/bench_sft.py --model-size demo --tp2-sizes   # demo only, no TP=2 row
    .venv/bin/python benchmarks/bench_sft.py --model-size big train.micro_batch_size=8 --rounds 3

Variants:

* `mcore`     -- the real training step: `build_trainer` + `train_step` from `mcore_rl.train.sft`
  (megatron-core GPTModel in megatron-core DDP, its no-pipelining schedule, `ModelParallelAdamW`),
  one rank, fp32.
* `reference` -- `McoreRLForCausalLM` (mcore_rl.hf) with the same weights, trained on the same
  micro-batches (`SFTBatches`, same rows, same seed) with its own forward: labels already aligned,
  `loss_mask`, `position_ids` restarting per document and a block-diagonal `attention_mask`
  (True = may attend) built from `segment_ids`. The loss is megatron's objective (token-summed over
  the global batch, divided by its token count, accumulated over micro-batches); the optimizer is the
  same wrapper, `build_optimizer([model], ...)`, stepping `param.grad`.
* `mcore TP=2` -- the `mcore` step on 2 ranks (torchrun, gloo, tensor_model_parallel_size=2);
  tokens/s is for the whole job, peak MB is the sum over both ranks.

Initial weights come from the reference model's seeded init, loaded into the megatron model through
`mcore_rl.hf.weight_map` and `mcore_rl.models.shards`. The losses of the first and last step of
every variant are printed, so "same model, same data, same updates" is checked on every run.

Every rank runs `--threads` intra-op threads (default 1): on a shared 2-core machine, more threads
than free cores make every OpenMP barrier wait for a descheduled thread (measured while another job
was compiling: the demo reference step went from 13 ms at 1 thread to 1.3 s at 2). So the single-rank
rows use one core and the TP=2 row two; `tok/s/core` divides by ranks x threads.

Throughput: processed tokens per step (global_batch_size x seq_length, padding included) over the
wall time of one full step (forward, backward, optimizer step), after `--warmup` untimed steps; the
median and the best of all timed steps. `mcore` and `reference` are timed in one subprocess that
alternates their steps (swapping the order every step), so load from other processes on a shared
machine hits both alike; the TP=2 job runs in between (pair, TP=2, pair, TP=2 for `--rounds 2`).

Peak memory: each variant runs alone in its own subprocess (`--worker mcore|reference`, 1 warmup + 2
steps; the TP=2 job's own runs for that row). Reported: the growth of the process's peak RSS,
`resource.getrusage(RUSAGE_SELF).ru_maxrss` after the last step minus before, with "before" taken
after all imports (and after the initial weights, which every variant holds, were generated) and
before the data, model and optimizer are built. On Linux the baseline first resets the high-water
mark to the current RSS (`echo 5 > /proc/self/clear_refs`), so a transient peak during imports does
not hide growth; where that file is missing the plain difference is used and can under-count.
Limits: RSS measures what the process holds, not what tensors need -- allocator caching and
fragmentation, code pages of kernels touched for the first time (oneDNN/MKL), Python objects (the
tokenised data set) all count, and memory freed before the baseline but kept by the allocator is
reused without raising RSS. It includes params, grads (megatron keeps a persistent fp32 `main_grad`
buffer), Adam state and activations; the maximum over rounds is reported (TP=2).
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

# Model-size presets: overrides applied before the user's own (which win).
SIZES: dict[str, list[str]] = {
    "demo": [],
    "big": [
        "model.hidden_size=256",
        "model.num_layers=4",
        "model.ffn_hidden_size=1024",
        "model.max_position_embeddings=256",
        "train.seq_length=256",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
    ],
}
# Steps per worker (timed, warmup) for each preset; --steps/--warmup override both.
STEPS = {"demo": (20, 5), "big": (8, 2)}


# --------------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------------


def _rss_baseline() -> int:
    """Reset the peak-RSS high-water mark to the current RSS where Linux allows; return ru_maxrss (KiB)."""
    import resource

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _maxrss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _initial_weights(cfg) -> dict:
    """HF-named fp32 state dict of a freshly initialised reference model (seeded)."""
    import torch

    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    torch.manual_seed(cfg.train.seed)
    model = McoreRLForCausalLM(hf_config_from_model_config(cfg.model)).float()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_mcore(cfg, weights: dict):
    """The real trainer (`build_trainer`) with `weights` (megatron global names) loaded; returns
    (step function returning the loss, teardown)."""
    import torch.distributed as dist

    from mcore_rl.models.shards import load_full_state_dict
    from mcore_rl.parallel import setup
    from mcore_rl.train.sft import build_trainer, train_step

    trainer = build_trainer(cfg)
    load_full_state_dict(trainer.chunks, weights)
    trainer.optimizer.reload_model_params()

    def step() -> float:
        if dist.get_world_size() > 1:
            dist.barrier()  # time whole-job steps: every rank starts together
        return train_step(trainer)["loss"]

    return step, setup.destroy


def build_reference(cfg, weights: dict):
    """`McoreRLForCausalLM` with `weights` (HF names), the same batch stream as `build_trainer`
    on one rank and the same optimizer wrapper; returns the step function (returning the loss)."""
    from mcore_rl.config import validate_sft_config
    from mcore_rl.data.sft import SFTBatches, build_sft_rows
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.train.optimizer import build_optimizer
    from mcore_rl.train.sft import _split_eval_rows

    sizes = validate_sft_config(cfg, 1)
    rows = build_sft_rows(cfg.data, cfg.train.seq_length, load_tokenizer(cfg.data.tokenizer_path), cfg.train.seed)
    train_rows, _ = _split_eval_rows(rows, cfg, 1)
    batches = SFTBatches(train_rows, cfg.train.micro_batch_size, sizes.num_microbatches, 0, 1, cfg.train.seed)
    model = McoreRLForCausalLM(hf_config_from_model_config(cfg.model)).float()
    model.load_state_dict(weights)
    optimizer = build_optimizer([model], cfg.optimizer, "fp32", cfg.train.train_iters)

    def step() -> float:
        model.train()
        optimizer.zero_grad()
        microbatches = next(batches)
        total = max(sum(float(mb["loss_mask"].sum()) for mb in microbatches), 1.0)
        loss_sum = 0.0
        for mb in microbatches:
            seg = mb["segment_ids"]
            allowed = (seg[:, :, None] == seg[:, None, :])[:, None]  # [b, 1, s, s], True = may attend
            out = model(
                mb["tokens"],
                position_ids=mb["position_ids"],
                labels=mb["labels"],
                loss_mask=mb["loss_mask"],
                attention_mask=allowed,
            )
            n = float(mb["loss_mask"].sum())
            # megatron's objective: token-summed loss over the global token count (+ MoE aux loss,
            # weighted by the micro-batch's token count, as megatron-core scales it)
            ((out.loss * n + out.aux_loss * mb["tokens"].numel()) / total).backward()
            loss_sum += float(out.loss.detach()) * n
        optimizer.step()
        return loss_sum / total

    return step


def _imports_for_baseline() -> None:
    """Import everything the variants use before the memory baseline, so no import counts as growth."""
    import megatron.core.pipeline_parallel  # noqa: F401  (imported for the baseline only)
    import mcore_rl.data.sft
    import mcore_rl.models.builder
    import mcore_rl.train.sft  # noqa: F401  (as above)


def worker_memory(cfg, args) -> dict[str, Any]:
    """One variant alone in this process: peak-RSS growth over the baseline, and step times."""
    import torch.distributed as dist

    from mcore_rl.hf.weight_map import hf_to_megatron

    _imports_for_baseline()
    weights = _initial_weights(cfg)
    if args.worker == "mcore":
        weights = hf_to_megatron(weights, cfg.model)
    before = _rss_baseline()
    if args.worker == "mcore":
        step, teardown = build_mcore(cfg, weights)
    else:
        step, teardown = build_reference(cfg, weights), None
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    growth = [(_maxrss_kib() - before) / 1024]
    if dist.is_initialized() and dist.get_world_size() > 1:
        import torch

        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, growth[0])
        growth = everyone
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank is done
        times = t.tolist()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if teardown:
        teardown()
    if rank != 0:
        return {}
    return {
        "times": {args.worker: times},
        "losses": {args.worker: losses},
        "peak_mib": sum(growth),
        "peak_mib_per_rank": growth,
        "world": len(growth),
    }


def worker_pair(cfg, args) -> dict[str, Any]:
    """Both single-rank variants in this process, stepped alternately (their order swapping every
    step), so that load from other processes hits them alike: step times only."""
    from mcore_rl.hf.weight_map import hf_to_megatron

    weights = _initial_weights(cfg)
    mcore_step, teardown = build_mcore(cfg, hf_to_megatron(weights, cfg.model))
    steps = {"mcore": mcore_step, "reference": build_reference(cfg, weights)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(args.warmup + args.steps):
        for name in list(steps) if i % 2 == 0 else list(steps)[::-1]:
            t0 = time.perf_counter()
            losses[name].append(steps[name]())
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    teardown()
    return {"times": times, "losses": losses}


def run_worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    import torch

    from mcore_rl.config import SFTConfig, load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(SFTConfig, args.config, args.overrides)
    cfg.checkpoint.load_dir = None  # build_trainer must not resume; it writes nothing itself
    result = (worker_pair if args.worker == "pair" else worker_memory)(cfg, args)
    if result:
        result["threads"] = torch.get_num_threads()
        with open(args.result_file, "w") as f:
            json.dump(result, f)


# --------------------------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------------------------


def launch(worker: str, tp: int, overrides: list[str], args, steps: int, warmup: int) -> dict[str, Any]:
    """Run one worker subprocess (under torchrun when tp > 1) and return its JSON result."""
    fd, result_file = tempfile.mkstemp(suffix=".json", prefix="bench_sft_")
    os.close(fd)
    worker_args = [
        os.path.abspath(__file__),
        "--worker",
        worker,
        "--config",
        args.config,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--threads",
        str(args.threads),
        "--result-file",
        result_file,
        *overrides,
    ]
    if tp > 1:
        worker_args.append(f"parallel.tensor_model_parallel_size={tp}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", *worker_args]
    else:
        cmd = [sys.executable, *worker_args]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)  # threads are set explicitly (torchrun would force 1)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        with open(result_file) as f:
            return json.load(f)
    finally:
        os.unlink(result_file)


def _summary(overrides: list[str], config: str) -> tuple[str, int]:
    sys.path.insert(0, REPO)
    from mcore_rl.config import SFTConfig, load_config

    cfg = load_config(SFTConfig, config, overrides)
    m, t = cfg.model, cfg.train
    qkv = m.hidden_size * (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
    layer = qkv + m.num_attention_heads * m.head_dim * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size
    params = m.num_layers * layer + m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return (
        f"hidden {m.hidden_size}, {m.num_layers} layers, ffn {m.ffn_hidden_size}, heads "
        f"{m.num_attention_heads}/{m.num_query_groups}, ~{params / 1e6:.2f}M params; seq {t.seq_length}, "
        f"mbs {t.micro_batch_size}, gbs {t.global_batch_size} -> {t.global_batch_size * t.seq_length} "
        f"tokens/step"
    ), t.global_batch_size * t.seq_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "overrides", nargs="*", help="dotted config overrides applied to every size, e.g. train.seq_length=128"
    )
    ap.add_argument("--config", default="configs/sft_demo.yaml")
    ap.add_argument(
        "--model-size",
        nargs="+",
        default=["demo", "big"],
        choices=sorted(SIZES),
        help="size presets to run (demo = the config as is; big = " + " ".join(SIZES["big"]) + ")",
    )
    ap.add_argument("--tp2-sizes", nargs="*", default=["big"], help="sizes that also get an mcore TP=2 row (2 ranks)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per worker (default: per size)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per worker (default: per size)")
    ap.add_argument("--rounds", type=int, default=2, help="round-robin repetitions of all variants")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--worker", choices=["pair", "mcore", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return

    import platform

    print(
        f"bench_sft: {args.config} {' '.join(args.overrides)}; {args.rounds} rounds; "
        f"{args.threads} thread(s) per rank; {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    )
    t_start = time.perf_counter()
    table = []
    for size in args.model_size:
        overrides = SIZES[size] + list(args.overrides)
        summary, tokens_per_step = _summary(overrides, args.config)
        steps, warmup = STEPS.get(size, (10, 2))
        steps, warmup = args.steps or steps, args.warmup if args.warmup is not None else warmup
        tp2 = size in args.tp2_sizes
        print(f"[{size}] {summary}; {steps} timed steps after {warmup} warmup per worker and round", flush=True)

        def timed(what: str, worker: str, tp: int, n: int, w: int) -> dict[str, Any]:
            t0 = time.perf_counter()
            res = launch(worker, tp, overrides, args, n, w)
            print(f"  {what:32s} {time.perf_counter() - t0:5.1f} s", flush=True)
            return res

        pairs, tps = [], []
        for r in range(args.rounds):  # subprocess-level round robin: pair, TP=2, pair, TP=2, ...
            pairs.append(timed(f"round {r + 1}: mcore+reference (speed)", "pair", 1, steps, warmup))
            if tp2:
                tps.append(timed(f"round {r + 1}: mcore TP=2 (speed, memory)", "mcore", 2, steps, warmup))
        memory = {v: timed(f"{v} alone (memory)", v, 1, 2, 1) for v in ("mcore", "reference")}

        rows = {
            "mcore": (
                [t for p in pairs for t in p["times"]["mcore"]],
                memory["mcore"]["peak_mib"],
                pairs[0]["losses"]["mcore"],
                pairs[0]["threads"],
                1,
            ),
            "reference": (
                [t for p in pairs for t in p["times"]["reference"]],
                memory["reference"]["peak_mib"],
                pairs[0]["losses"]["reference"],
                pairs[0]["threads"],
                1,
            ),
        }
        if tp2:
            rows["mcore TP=2"] = (
                [t for p in tps for t in p["times"]["mcore"]],
                max(p["peak_mib"] for p in tps),
                tps[0]["losses"]["mcore"],
                tps[0]["threads"],
                tps[0]["world"],
            )
        for name, (times, peak, losses, threads, world) in rows.items():
            table.append(
                dict(
                    size=size,
                    variant=name,
                    tok_s=tokens_per_step / statistics.median(times),
                    best=tokens_per_step / min(times),
                    peak=peak,
                    loss1=losses[0],
                    loss_last=losses[-1],
                    threads=threads,
                    world=world,
                )
            )

    print(
        f"\nresults (wall {time.perf_counter() - t_start:.0f} s); tokens/s = median (best) over all timed "
        "steps; peak MB = peak-RSS growth, summed over ranks; ratio = variant / reference"
    )
    header = (
        f"{'size':5s} {'variant':11s} {'ranks x thr':>11s} {'tokens/s':>9s} {'(best)':>8s} {'peak MB':>8s} "
        f"{'tok/s/core':>10s} {'tok/s ratio':>11s} {'MB ratio':>8s} {'loss step1':>11s} {'loss last':>10s}"
    )
    print(header)
    print("-" * len(header))
    for row in table:
        ref = next(x for x in table if x["size"] == row["size"] and x["variant"] == "reference")
        print(
            f"{row['size']:5s} {row['variant']:11s} {str(row['world']) + ' x ' + str(row['threads']):>11s} "
            f"{row['tok_s']:9.0f} {'(' + format(row['best'], '.0f') + ')':>8s} {row['peak']:8.1f} "
            f"{row['tok_s'] / (row['world'] * row['threads']):10.0f} {row['tok_s'] / ref['tok_s']:10.2f}x {row['peak'] / ref['peak']:7.2f}x "
            f"{row['loss1']:11.6f} {row['loss_last']:10.6f}"
        )


if __name__ == "__main__":
    main()
