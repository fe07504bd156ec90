"""PNG curves of runs' `metrics.jsonl`: the curves a finished RL run draws (`curves.png`: reward,
evaluation score, mismatch; per domain in a multi-domain run) and `mcore-rl plot <run_dir> ...`,
which puts one or several runs side by side, one panel per metric and one line per run.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any
from collections.abc import Iterable, Sequence

from mcore_rl.observe.sinks import read_metrics
from mcore_rl.observe.timers import PHASES, phase_key


def _series(records: Iterable[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def domains_of(records: Iterable[dict[str, Any]]) -> list[str]:
    """The domains a multi-domain run logged (`reward/<domain>/mean`), in order of appearance."""
    seen: dict[str, None] = {}
    for r in records:
        for key in r:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean":
                seen.setdefault(parts[1])
    return list(seen)


def plot_curves(records: list[dict[str, Any]], path: str, title: str | None = None) -> str:
    """Training reward (per rollout batch), held-out eval score, mismatch K3 and, in a multi-domain
    run, the response length: one line for the run and one per domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = domains_of(records)
    panels = [
        ("reward/mean", "reward/{}/mean", "training reward (mean over rollouts)"),
        ("eval/score", "eval/{}/score", "held-out eval score"),
        ("mismatch/k3", "mismatch/{}/k3", "mismatch K3 (exp(d)-d-1, d = log π - log μ)"),
    ]
    if domains:
        panels.append(("response/length_mean", "response/{}/length_mean", "response length (tokens)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, per_domain, label) in zip(axes, panels):
        lines = [(key, "all" if domains else None)] + [(per_domain.format(d), d) for d in domains]
        for k, name in lines:
            xs, ys = _series(records, k)
            if xs:
                ax.plot(
                    xs,
                    ys,
                    marker="o" if key == "eval/score" else None,
                    markersize=3,
                    label=name,
                    linewidth=2 if name == "all" else 1,
                )
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if domains:
            ax.legend(fontsize=8)
        ys_all = [y for k, _ in lines for y in _series(records, k)[1]]
        if key == "mismatch/k3" and ys_all and min(ys_all) > 0:
            ax.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# what `mcore-rl plot` draws without --keys (those no run logged are left out); "time/*" is one
# panel with a line per phase
DEFAULT_KEYS = (
    "reward/mean",
    "eval/score",
    "train/loss",
    "loss",
    "eval_loss",
    "mismatch/k3",
    "time/*",
    "perf/mfu",
    "perf/tokens_per_s_per_device",
)


def _run_records(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        why = "is not a directory" if not os.path.isdir(run_dir) else "holds no metrics.jsonl"
        raise FileNotFoundError(f"{run_dir}: {why} (a run directory of `mcore-rl train` or `mcore-rl sft`)")
    records = [r for r in read_metrics(path) if "step" in r]
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _phase_keys(runs: Sequence[list[dict[str, Any]]]) -> list[str]:
    logged = {k for records in runs for r in records for k in r}
    return [phase_key(p) for p in PHASES if phase_key(p) in logged]


def plot_runs(run_dirs: Sequence[str], out: str, keys: Sequence[str] | None = None) -> tuple[str, list[str]]:
    """One panel per key, one line per run; returns the PNG's path and the keys drawn. Chosen keys
    that no run logged are an error naming them; of the defaults, the missing are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [_run_records(d) for d in run_dirs]
    logged = {k for records in runs for r in records for k in r}
    wanted = list(keys) if keys else list(DEFAULT_KEYS)
    present = [k for k in wanted if (k == "time/*" and _phase_keys(runs)) or k in logged]
    if keys and len(present) < len(wanted):
        missing = [k for k in wanted if k not in present]
        numeric = sorted(k for k in logged if k != "step")
        raise ValueError(f"--keys: no run logged {', '.join(missing)}; they logged: {', '.join(numeric)}")
    if not present:
        raise ValueError(f"none of {', '.join(wanted)} is in the metrics of {', '.join(run_dirs)}; choose with --keys")
    cols = min(len(present), 4)
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    names = [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    styles = ["-", "--", ":", "-."]
    for ax, key in zip(axes.flat, present):
        if key == "time/*":
            for p, phase in enumerate(_phase_keys(runs)):
                for i, (records, name) in enumerate(zip(runs, names)):
                    xs, ys = _series(records, phase)
                    if xs:
                        label = phase.removeprefix("time/").removesuffix("_s") + (f" ({name})" if len(runs) > 1 else "")
                        ax.plot(xs, ys, linestyle=styles[i % 4], color=f"C{p}", label=label, marker=".")
            ax.set_title("time per phase (s)", fontsize=10)
        else:
            for i, (records, name) in enumerate(zip(runs, names)):
                xs, ys = _series(records, key)
                if xs:
                    ax.plot(xs, ys, label=name, color=f"C{i}", marker="o" if len(xs) < 30 else None, markersize=3)
            ax.set_title(key, fontsize=10)
            if key == "mismatch/k3" and all(y > 0 for r in runs for y in _series(r, key)[1]):
                ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out, present


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("run_dirs", nargs="+", help="run directories (each with a metrics.jsonl)")
    ap.add_argument(
        "--keys",
        default="",
        help="comma-separated metric keys, one panel each ('time/*': every "
        f"phase's time); default: those of {', '.join(DEFAULT_KEYS)} the runs logged",
    )
    ap.add_argument("--out", default="", help="PNG path (default: <first run_dir>/plot.png)")


def main(args: argparse.Namespace) -> int:
    keys = [k.strip() for k in args.keys.split(",") if k.strip()]
    out = args.out or os.path.join(args.run_dirs[0], "plot.png")
    try:
        path, drawn = plot_runs(args.run_dirs, out, keys or None)
    except (FileNotFoundError, ValueError) as err:
        import sys

        print(f"mcore-rl plot: {err}", file=sys.stderr)
        return 2
    print(f"{path}: {', '.join(drawn)} of {len(args.run_dirs)} run(s)")
    return 0
