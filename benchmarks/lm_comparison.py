"""A small from-scratch language-modelling comparison on CPU: dense vs Over-Encoding vs Block AttnRes,
and an MoE baseline vs LatentMoE -- same data, same token budget, same seed, one PNG.

    .venv/bin/python benchmarks/lm_comparison.py         # 6 default variants -> docs/lm_comparison.png
    .venv/bin/python benchmarks/lm_comparison.py --variants dense dense_seed2 oe attnres moe latent_acc latent_eff latent_a1
    .venv/bin/python benchmarks/lm_comparison.py --steps 100 --jobs 1   # quicker, noisier

The default set costs ~1000 CPU-seconds of training (2 jobs: an estimated ~10 min on an idle 2-core machine;
16 min were measured at a load average of ~12); the 8-variant line (which drew the committed
docs/lm_comparison.png) ~40% more.

Data: real text present on every machine without downloads -- the top-level `*.py` files of the
running Python's standard library (`sysconfig.get_paths()["stdlib"]`, 168 files / 4.7 MB for
CPython 3.11), in sorted-name order. Every 10th file (index % 10 == 5) is held out for the eval
loss, the rest are training data. Each file is cut at line boundaries into chunks of at most
`seq_length - 1` UTF-8 bytes (a longer line is split), so that `[bos] chunk [eos]` fills one row of
the bundled byte-level tokenizer (vocabulary 384); the chunks are written to
`<out-dir>/train.jsonl` / `eval.jsonl` as `{"text": ...}` lines and read by the project's SFT data
pipeline (`data.path=..., data.format=jsonl`, packed rows, loss on every token). The training rows
are drawn by `SFTBatches` (seeded permutation); with the defaults the run sees ~0.48M tokens, well
under one epoch, so training loss is itself a held-out-like estimate. The eval loss is the
token-mean loss of `--eval-rows` evenly spaced rows of the held-out files (`mcore_rl.train.sft.
evaluate` on rows built by `build_sft_rows`), measured before training and every
`--eval-interval` steps.

Training: the real megatron-core loop pieces, `build_trainer` + `train_step`, one rank, fp32, one
thread per process (`--jobs` variants run side by side as separate processes). Every variant uses
the same config (`BASE`) apart from its architecture keys, the same seed (so the same batches in the
same order) and the same optimizer schedule (AdamW, lr 3e-3, 20 warmup steps, cosine to 3e-4,
clip 1.0).

Variants (8 layers, hidden 128, 4 heads / 2 KV groups, seq 128, 16 rows per step):
* `dense`      -- Qwen3-style, SwiGLU ffn 384.
* `dense_seed2` -- `dense` with another seed (init and batch order): the run-to-run noise floor.
* `oe`         -- `dense` + Over-Encoding: 2- and 3-gram hashed tables, 2 slices each, m = 49157
  (~128 x vocab, coprime with 384): 5.2M table parameters on a 1.7M-parameter model.
* `attnres`    -- `dense` with Block AttnRes, N = 8 blocks (of 2 sublayers each).
* `moe`        -- every MLP an MoE: N = 8 experts, top-2, expert ffn 192 (active ffn width 384 =
  `dense`'s), load-balancing aux loss 0.01 (all MoE variants; without it the routers collapse onto
  a few experts within tens of steps). The plotted losses are the LM loss alone.
* `latent_acc` -- LatentMoE l-MoE_acc, alpha = 4: latent 32, N' = 32 experts, K' = 8, expert ffn 192.
* `latent_eff` -- (not in the default set) l-MoE_eff: latent 32, N' = 32, K = 2.
* `latent_a1`  -- (not in the default set) the LatentMoE layer with alpha = 1 (latent 128 = d,
  N = 8, K = 2): `moe` plus the two d x d projections, to separate the cost of the projections from
  that of the compression.

`--reuse` keeps the results of variants already trained in `--out-dir` with the same steps and
eval settings (e.g. add `latent_eff latent_a1` to an earlier run without retraining the others).

Results are written to `<out-dir>/results.json` and plotted to `--png`: left, the training loss
(moving average over `--smooth` steps) against tokens; middle, the eval loss; right, the eval loss
minus that of the variant's baseline (`BASELINE`: dense for OE, AttnRes, MoE and the second seed;
the MoE baseline for the LatentMoE variants). The step times in the
summary are only indicative (the processes share the machine with each other and anything else);
`benchmarks/bench_architectures.py` measures speed properly.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/sft_demo.yaml"

BASE = [
    "model.hidden_size=128",
    "model.num_layers=8",
    "model.ffn_hidden_size=384",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.max_position_embeddings=256",
    "train.seq_length=128",
    "train.micro_batch_size=16",
    "train.global_batch_size=16",
    "train.eval_interval=0",  # evaluation is driven here, on the held-out files
    "train.log_interval=1000000",
    "optimizer.lr=3e-3",
    "optimizer.min_lr=3e-4",
    "optimizer.lr_warmup_iters=20",
    "optimizer.lr_decay_style=cosine",
    "optimizer.clip_grad=1.0",
    "optimizer.weight_decay=0.0",
    "data.format=jsonl",
    "data.pack_sequences=true",
    "train.seed=1234",
]
MOE = ["model.arch=qwen3_moe", "model.moe_ffn_hidden_size=192", "model.moe_aux_loss_coeff=0.01"]
VARIANTS: dict[str, tuple[str, list[str]]] = {  # name -> (label, overrides)
    "dense": ("dense baseline", []),
    "dense_seed2": ("dense baseline, seed 4321", ["train.seed=4321"]),
    "oe": (
        "Over-Encoding (2,3-gram, m=49157)",
        ["model.ngram.orders=[2,3]", "model.ngram.table_size=49157", "model.ngram.num_slices=2"],
    ),
    "attnres": ("Block AttnRes (N=8)", ["model.attn_res=block", "model.attn_res_num_blocks=8"]),
    "moe": ("MoE baseline (N=8, K=2)", MOE + ["model.num_experts=8", "model.moe_router_topk=2"]),
    "latent_acc": (
        "LatentMoE acc (a=4, N'=32, K'=8)",
        MOE + ["model.num_experts=32", "model.moe_router_topk=8", "model.moe_latent_size=32"],
    ),
    "latent_eff": (
        "LatentMoE eff (a=4, N'=32, K=2)",
        MOE + ["model.num_experts=32", "model.moe_router_topk=2", "model.moe_latent_size=32"],
    ),
    "latent_a1": (
        "LatentMoE a=1 (latent 128 = d, N=8, K=2)",
        MOE + ["model.num_experts=8", "model.moe_router_topk=2", "model.moe_latent_size=128"],
    ),
}
DEFAULT_VARIANTS = ["dense", "dense_seed2", "oe", "attnres", "moe", "latent_acc"]
BASELINE = {
    "dense_seed2": "dense",
    "oe": "dense",
    "attnres": "dense",
    "moe": "dense",
    "latent_acc": "moe",
    "latent_eff": "moe",
    "latent_a1": "moe",
}  # what the difference panel subtracts
STYLE = {
    "dense": ("C0", "-"),
    "dense_seed2": ("C7", ":"),
    "oe": ("C1", "-"),
    "attnres": ("C2", "-"),
    "moe": ("C3", "--"),
    "latent_acc": ("C4", "--"),
    "latent_eff": ("C5", "--"),
    "latent_a1": ("C8", "--"),
}


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def stdlib_files() -> list[str]:
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")), key=os.path.basename)


def chunk_text(text: str, max_bytes: int) -> list[str]:
    """Consecutive lines of `text` grouped into chunks of at most `max_bytes` UTF-8 bytes."""
    chunks, cur, cur_len = [], [], 0
    for line in text.splitlines(keepends=True):
        while len(line.encode("utf-8")) > max_bytes:  # split an over-long line
            cut = max_bytes
            while len(line[:cut].encode("utf-8")) > max_bytes:
                cut -= 1
            if cur:
                chunks.append("".join(cur))
                cur, cur_len = [], 0
            chunks.append(line[:cut])
            line = line[cut:]
        n = len(line.encode("utf-8"))
        if cur and cur_len + n > max_bytes:
            chunks.append("".join(cur))
            cur, cur_len = [], 0
        cur.append(line)
        cur_len += n
    if cur:
        chunks.append("".join(cur))
    return [c for c in chunks if c.strip()]


def write_data(out_dir: str, seq_length: int) -> dict[str, Any]:
    """train.jsonl / eval.jsonl from the stdlib sources; returns a description of the split."""
    os.makedirs(out_dir, exist_ok=True)
    files = stdlib_files()
    if not files:
        raise SystemExit(f"no *.py files in {sysconfig.get_paths()['stdlib']}")
    stats = {"stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0]}
    for split, keep in (("train", lambda i: i % 10 != 5), ("eval", lambda i: i % 10 == 5)):
        chosen = [f for i, f in enumerate(files) if keep(i)]
        n_bytes, n_chunks = 0, 0
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as out:
            for path in chosen:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                n_bytes += len(text.encode("utf-8"))
                for chunk in chunk_text(text, seq_length - 1):
                    out.write(json.dumps({"text": chunk}) + "\n")
                    n_chunks += 1
        stats[split] = {
            "files": len(chosen),
            "bytes": n_bytes,
            "chunks": n_chunks,
            "names": [os.path.basename(p) for p in chosen] if split == "eval" else None,
        }
    return stats


# --------------------------------------------------------------------------------------------
# worker: train one variant
# --------------------------------------------------------------------------------------------


def train_variant(args) -> dict[str, Any]:
    import torch

    from mcore_rl.config import SFTConfig, load_config
    from mcore_rl.data.sft import build_sft_rows
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.parallel import setup
    from mcore_rl.train.sft import build_trainer, evaluate, train_step

    overrides = (
        BASE
        + VARIANTS[args.worker][1]
        + [
            f"data.path={os.path.join(args.out_dir, 'train.jsonl')}",
            f"train.train_iters={args.steps}",
        ]
    )
    cfg = load_config(SFTConfig, os.path.join(REPO, CONFIG), overrides)
    cfg.checkpoint.load_dir = cfg.checkpoint.save_dir = None
    trainer = build_trainer(cfg)

    eval_cfg = load_config(
        SFTConfig,
        os.path.join(REPO, CONFIG),
        overrides[:-2] + [f"data.path={os.path.join(args.out_dir, 'eval.jsonl')}"],
    ).data
    rows = build_sft_rows(eval_cfg, cfg.train.seq_length, load_tokenizer(None), cfg.train.seed)
    n = next(iter(rows.values())).shape[0]
    n_eval = min(args.eval_rows, n) // cfg.train.micro_batch_size * cfg.train.micro_batch_size
    pick = torch.linspace(0, n - 1, n_eval).round().long()  # evenly spaced over the held-out files
    trainer.eval_rows = {k: v[pick] for k, v in rows.items()}
    eval_tokens = float(trainer.eval_rows["loss_mask"].sum())

    params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    train, evals, tokens, times = [], [], 0.0, []
    evals.append({"step": 0, "tokens": 0.0, "loss": evaluate(trainer)})
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        out = train_step(trainer)
        times.append(time.perf_counter() - t0)
        tokens += out["num_tokens"]
        train.append({"step": step, "tokens": tokens, "loss": out["loss"]})
        if step % args.eval_interval == 0 or step == args.steps:
            evals.append({"step": step, "tokens": tokens, "loss": evaluate(trainer)})
            print(f"{args.worker}: step {step} loss {out['loss']:.4f} eval {evals[-1]['loss']:.4f}", flush=True)
    setup.destroy()
    return {
        "variant": args.worker,
        "settings": _settings(args, args.worker),
        "params": params,
        "train": train,
        "eval": evals,
        "step_s": times,
        "eval_tokens": eval_tokens,
        "eval_rows": n_eval,
        "train_rows": trainer.batches.num_rows,
    }


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _settings(args, variant: str) -> dict[str, Any]:
    """What a variant's results depend on (besides the code and the data), for `--reuse`."""
    return {
        "steps": args.steps,
        "eval_interval": args.eval_interval,
        "eval_rows": args.eval_rows,
        "base": BASE,
        "overrides": VARIANTS[variant][1],
    }


def _reusable(args, v: str) -> bool:
    path = os.path.join(args.out_dir, f"{v}.json")
    if not (args.reuse and os.path.exists(path)):
        return False
    with open(path) as f:
        return json.load(f).get("settings") == _settings(args, v)


def run_all(args) -> dict[str, dict]:
    env = dict(
        os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS=str(args.threads)
    )
    pending = [v for v in args.variants if not _reusable(args, v)]
    for v in args.variants:
        if v not in pending:
            print(f"  reusing {v} from {args.out_dir}", flush=True)
    running: dict[str, tuple[subprocess.Popen, float, Any]] = {}
    results = {}
    while pending or running:
        while pending and len(running) < args.jobs:
            v = pending.pop(0)
            log = open(os.path.join(args.out_dir, f"{v}.log"), "w")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                v,
                "--out-dir",
                args.out_dir,
                "--steps",
                str(args.steps),
                "--eval-interval",
                str(args.eval_interval),
                "--eval-rows",
                str(args.eval_rows),
                "--threads",
                str(args.threads),
            ]
            running[v] = (
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
                time.perf_counter(),
                log,
            )
            print(f"  started {v}", flush=True)
        time.sleep(1)
        for v, (proc, t0, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[v]
            if proc.returncode != 0:
                with open(os.path.join(args.out_dir, f"{v}.log")) as f:
                    tail = f.read()[-3000:]
                for p, _, _ in running.values():
                    p.kill()
                raise RuntimeError(f"variant {v} failed ({proc.returncode}):\n{tail}")
            with open(os.path.join(args.out_dir, f"{v}.json")) as f:
                results[v] = json.load(f)
            print(f"  finished {v} in {time.perf_counter() - t0:.0f} s", flush=True)
    for v in args.variants:
        if v not in results:
            with open(os.path.join(args.out_dir, f"{v}.json")) as f:
                results[v] = json.load(f)
    return {v: results[v] for v in args.variants}


def smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(results: dict[str, dict], stats: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(19, 5.5))
    for v, res in results.items():
        color, ls = STYLE[v]
        label = f"{VARIANTS[v][0]}, {res['params'] / 1e6:.2f}M params"
        x = [r["tokens"] / 1e6 for r in res["train"]]
        y = [r["loss"] for r in res["train"]]
        ax1.plot(x, y, color=color, alpha=0.12, lw=0.7)
        ax1.plot(x, smooth(y, args.smooth), color=color, ls=ls, lw=1.6, label=label)
        ax2.plot(
            [r["tokens"] / 1e6 for r in res["eval"]],
            [r["loss"] for r in res["eval"]],
            color=color,
            ls=ls,
            marker="o",
            ms=3,
            lw=1.4,
            label=label,
        )
        base = BASELINE.get(v)
        if base in results:
            ref = {r["step"]: r["loss"] for r in results[base]["eval"]}
            pts = [
                (r["tokens"] / 1e6, r["loss"] - ref[r["step"]])
                for r in res["eval"]
                if r["step"] in ref and r["step"] > 0
            ]
            ax3.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color=color,
                ls=ls,
                marker="o",
                ms=3,
                lw=1.4,
                label=f"{VARIANTS[v][0]} - {VARIANTS[base][0]}",
            )
    ax1.set_title(f"training loss ({args.smooth}-step moving average; raw faint)")
    ax2.set_title(
        f"eval loss on {stats['eval']['files']} held-out stdlib files "
        f"({next(iter(results.values()))['eval_rows']} rows)"
    )
    ax3.set_title("eval loss minus its baseline's (below 0 = better)")
    ax3.axhline(0.0, color="k", lw=0.8)
    all_final = [r["train"][-1]["loss"] for r in results.values()]
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("training tokens (M, loss-masked)")
        ax.grid(alpha=0.3)
    for ax in (ax1, ax2):
        ax.set_ylabel("cross-entropy (nats / byte token)")
        ax.set_ylim(max(0.0, min(all_final) - 0.4), min(all_final) + 2.2)
    ax3.set_ylabel("difference (nats / byte token)")
    ax2.legend(fontsize=8)
    ax3.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    fig.suptitle(
        f"From scratch on Python {stats['python']} stdlib source (byte tokens), 8 layers x 128 hidden, "
        f"{args.steps} steps x 16 x 128, seed 1234, megatron-core fp32 on CPU",
        fontsize=10,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    fig.savefig(args.png, dpi=110, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-interval", type=int, default=25)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=2, help="variants trained side by side (processes)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--smooth", type=int, default=20, help="moving-average window of the plotted training loss")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "runs", "lm_comparison"))
    ap.add_argument("--png", default=os.path.join(REPO, "docs", "lm_comparison.png"))
    ap.add_argument("--reuse", action="store_true", help="keep variants already trained in --out-dir (same settings)")
    ap.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out_dir = os.path.abspath(args.out_dir)

    if args.worker:
        import warnings

        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
        import torch

        torch.set_num_threads(args.threads)
        result = train_variant(args)
        with open(os.path.join(args.out_dir, f"{args.worker}.json"), "w") as f:
            json.dump(result, f)
        return

    t_start = time.perf_counter()
    seq = int(next(o for o in BASE if o.startswith("train.seq_length=")).split("=")[1])
    stats = write_data(args.out_dir, seq)
    print(
        f"data: Python {stats['python']} stdlib {stats['stdlib']}: train {stats['train']['files']} files "
        f"{stats['train']['bytes'] / 1e6:.2f} MB -> {stats['train']['chunks']} chunks; eval "
        f"{stats['eval']['files']} files {stats['eval']['bytes'] / 1e6:.2f} MB -> {stats['eval']['chunks']} chunks "
        f"({', '.join(stats['eval']['names'])})",
        flush=True,
    )
    results = run_all(args)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"data": stats, "args": vars(args), "results": results}, f)
    plot(results, stats, args)

    import statistics

    print(
        f"\nresults (wall {time.perf_counter() - t_start:.0f} s); {args.steps} steps; train loss = mean of the "
        f"last {args.smooth} steps; eval = held-out files; s/step median (indicative only: {args.jobs} jobs share the CPU)"
    )
    header = f"{'variant':34s} {'params':>7s} {'train loss':>10s} {'eval @0':>8s} {'eval mid':>8s} {'eval end':>8s} {'best eval':>9s} {'s/step':>7s}"
    print(header)
    print("-" * len(header))
    for v, res in results.items():
        last = [r["loss"] for r in res["train"][-args.smooth :]]
        ev = [r["loss"] for r in res["eval"]]
        print(
            f"{VARIANTS[v][0]:34s} {res['params'] / 1e6:6.2f}M {statistics.mean(last):10.4f} {ev[0]:8.4f} "
            f"{ev[len(ev) // 2]:8.4f} {ev[-1]:8.4f} {min(ev):9.4f} {statistics.median(res['step_s']):7.3f}"
        )
    print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
