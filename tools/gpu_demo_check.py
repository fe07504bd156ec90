"""Why the demo's SFT warm start behaves differently on a GPU: the prepared device check.

On one H200 the demo's warm start (configs/demo.yaml, seed 1234) ended at loss 0.81 after 500
steps and RL moved held-out avg@4 only 6.6% -> 10.8%, while on CPU the same seed reaches 0.13 and
75% -> 90% (docs/gpu.md). This runs the warm start and the first evaluation in several variants side by
side on one machine, in parallel, and prints one table of the SFT loss every 100 steps and held-out
avg@4 before RL:

  cpu        the CPU path on the same machine (CUDA hidden): the reference
  cuda       the GPU path as a user gets it
  cuda_cpuinit  the GPU path with megatron-core's `use_cpu_initialization` (the CPU path's initial
             weights, drawn from the CPU generator): separates "another draw" from "another computation"
  cuda_notf32   the GPU path with TF32 matmuls forbidden (in case anything turned them on)
  cuda seeds 1-4, cpu seed 1: whether GPU draws plateau as a rule or by chance

    python tools/gpu_demo_check.py                  # all variants (about 2 minutes on an H200 machine)
    python tools/gpu_demo_check.py --only cpu       # here, without a GPU: the CPU rows alone
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = re.compile(r"sft warm start\s+(\d+)/\d+ \| loss ([0-9.]+)")

VARIANTS: dict[str, tuple[str, int, list[str]]] = {  # name -> (device, seed, flags of the child)
    "cpu_1234": ("cpu", 1234, []),
    "cuda_1234": ("cuda", 1234, []),
    "cuda_cpuinit_1234": ("cuda", 1234, ["--cpu-init"]),
    "cuda_notf32_1234": ("cuda", 1234, ["--no-tf32"]),
    "cuda_1": ("cuda", 1, []),
    "cuda_2": ("cuda", 2, []),
    "cuda_3": ("cuda", 3, []),
    "cuda_4": ("cuda", 4, []),
    "cpu_1": ("cpu", 1, []),
}


def child(args: argparse.Namespace) -> int:
    """One variant in this process: patch, then `mcore-rl train` in-process."""
    import torch

    if args.no_tf32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    if args.cpu_init:
        import mcore_rl.models.builder as builder

        original = builder.transformer_config

        def cpu_initialised(*a, **k):
            config = original(*a, **k)
            config.use_cpu_initialization = True
            return config

        builder.transformer_config = cpu_initialised
    from mcore_rl.cli import main

    rc = main(["train", "configs/demo.yaml", *args.overrides])
    flags = {
        "cuda": torch.cuda.is_available(),
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "matmul_precision": torch.get_float32_matmul_precision(),
    }
    print("FLAGS " + json.dumps(flags), flush=True)
    return rc


def summarise(name: str, log: str, run_dir: str, seconds: float, rc: int) -> str:
    losses = {int(step): float(loss) for step, loss in LOSS.findall(log)}
    flags = re.search(r"FLAGS (\{.*\})", log)
    evals = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            evals = [r["eval/avg@4"] for r in map(json.loads, f) if "eval/avg@4" in r]
    curve = " ".join(f"{losses[s]:.2f}" for s in sorted(losses)) or "-"
    before = f"{evals[0]:.1%}" if evals else "-"
    after = f"{evals[-1]:.1%}" if len(evals) > 1 else "-"
    tf32 = json.loads(flags.group(1))["allow_tf32"] if flags else "?"
    tail = "" if rc == 0 else f" (exit {rc}: {log.strip().splitlines()[-1][:160] if log.strip() else ''})"
    return f"| {name} | {curve} | {before} | {after} | {tf32} | {seconds:.0f} s{tail} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-init", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-tf32", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help="run only the variants whose name contains this")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    ap.add_argument("--out", default="", help="append the end of each variant's log to this file")
    ap.add_argument(
        "--recipes", nargs="*", default=[], help="a sweep: each a space-separated set of overrides (r0, r1, ...)"
    )
    ap.add_argument("--seeds", nargs="*", type=int, default=[1234, 1, 2, 3, 4], help="the sweep's seeds")
    ap.add_argument("--devices", nargs="*", default=["cuda", "cpu"], help="the sweep's devices")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch

    cuda = torch.cuda.is_available()
    variants: dict[str, tuple[str, int, list[str], list[str]]] = {
        name: (device, seed, flags, []) for name, (device, seed, flags) in VARIANTS.items()
    }
    if args.recipes:  # a sweep instead: every recipe x seed x device
        variants = {}
        for i, recipe in enumerate(args.recipes):
            for seed in args.seeds:
                for device in args.devices:
                    variants[f"r{i}_{device}_{seed}"] = (device, seed, [], recipe.split())
    names = [n for n in variants if args.only in n and (cuda or variants[n][0] == "cpu")]
    tmp = tempfile.mkdtemp(prefix="gpu_demo_check_")
    procs = {}
    for name in names:
        device, seed, flags, recipe = variants[name]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env.setdefault("OMP_NUM_THREADS", "2")
        run_dir = os.path.join(tmp, name)
        # the warm start, the evaluation before RL, two RL steps and the evaluation after them
        overrides = [
            f"run_dir={run_dir}",
            f"train.seed={seed}",
            "train.num_steps=2",
            "eval.interval=2",
            *args.overrides,
            *recipe,
        ]
        log = open(os.path.join(tmp, name + ".log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", *flags, *overrides]
        procs[name] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log, run_dir)
    start = time.monotonic()
    atexit.register(lambda: [p.kill() for p, _, _ in procs.values() if p.poll() is None])  # no child outlives it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` ends it: atexit still runs
    rows = [
        "| variant | SFT loss at each fifth of the warm start | held-out avg@4 before RL | after RL | TF32 | time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, (proc, log, run_dir) in procs.items():
        try:
            rc = proc.wait(timeout=max(1, args.timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
        log.close()
        with open(os.path.join(tmp, name + ".log")) as f:
            text = f.read()
        if args.out:  # one file: the end of every variant's log
            with open(args.out, "a") as f:
                f.write(f"===== {name} (exit {rc})\n{text[-20_000:]}\n")
        rows.append(summarise(name, text, run_dir, time.monotonic() - start, rc))
    device = torch.cuda.get_device_name() if cuda else "no CUDA device"
    print(f"Demo warm start on {device}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    for i, recipe in enumerate(args.recipes):
        print(f"r{i}: {recipe}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
