"""vLLM engines vs the embedded engine on the RL demo's model (docs/serving.md#vllm-engines).

    python benchmarks/bench_vllm_engine.py parity --dtype float32    # mcore-rl parity, vLLM next to embedded
    python benchmarks/bench_vllm_engine.py parity --dtype bfloat16
    python benchmarks/bench_vllm_engine.py demo --repeats 2           # demo time per step, alternating A/B

`parity` starts one vLLM server of the demo's model (head dim 32) and runs `mcore-rl parity`
against it, with the embedded engine at the same precision in the same report. `demo` runs the
demo for a few steps (no SFT warm start) with a vLLM engine the trainer starts and with the
embedded engine, alternating, and prints the median and spread of `time/step_s`,
`time/generate_s` and `time/sync_s` (steps after the first). Needs `bash tools/setup_vllm.sh`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from mcore_rl.config.schema import ModelConfig
from mcore_rl.rollout.vllm_processes import VLLMEngineProcesses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
COMMON = ["rollout.quantization=none", "model.kv_channels=32", "init.sft_steps=0"]
DEMO_MODEL = ModelConfig(
    vocab_size=384,
    hidden_size=64,
    ffn_hidden_size=256,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=32,
    max_position_embeddings=256,
)


def mcore_rl(*args: str) -> None:
    env = {**os.environ, "MCORE_RL_PROGRESS": "0"}
    subprocess.run([sys.executable, "-m", "mcore_rl.cli", *args], check=True, env=env, cwd=ROOT)


def parity(dtype: str, prompts: int, samples: int) -> None:
    precision = "none" if dtype == "float32" else "bf16"
    with tempfile.TemporaryDirectory() as tmp:
        with VLLMEngineProcesses.start_vllm(
            DEMO_MODEL, num=1, workdir=tmp, dtype=dtype, context_length=256, startup_timeout_s=900
        ) as procs:
            out = os.path.join(tmp, "parity.json")
            overrides = [*COMMON, "rollout.engine_kind=vllm", "rollout.sync_transport=disk"]
            overrides += [f"rollout.sync_dir={os.path.join(tmp, 'weights')}", f"run_dir={os.path.join(tmp, 'run')}"]
            overrides[0] = f"rollout.quantization={precision}"
            mcore_rl(
                "parity", DEMO, *overrides, "--precisions", precision, "--engine-url", procs.urls[0],
                "--prompts", str(prompts), "--samples", str(samples), "--position-bins", "1", "--no-layers",
                "--json", out,
            )  # fmt: skip
            with open(out) as f:
                print(json.dumps(json.load(f), indent=1)[:4000])


def demo(repeats: int, steps: int) -> None:
    keys = ("time/step_s", "time/generate_s", "time/sync_s")
    figures: dict[str, dict[str, list[float]]] = {"vllm": {k: [] for k in keys}, "embedded": {k: [] for k in keys}}
    for r in range(repeats):
        for kind in ("vllm", "embedded"):  # alternating: the machine's load changes over minutes
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = os.path.join(tmp, "run")
                extra = [f"run_dir={run_dir}", f"train.num_steps={steps}", "eval.interval=0", "eval.at_start=false"]
                extra += ["eval.num_prompts=8", "eval.k=1"]
                if kind == "vllm":
                    extra += ["rollout.engine_kind=vllm", "rollout.sync_transport=disk"]
                    extra += [f"rollout.sync_dir={os.path.join(tmp, 'weights')}"]
                mcore_rl("train", DEMO, *COMMON, *extra)
                with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                    rows = [m for m in map(json.loads, f) if "time/step_s" in m and m["rl_step"] > 1]
                for k in keys:
                    figures[kind][k] += [m[k] for m in rows]
                print(kind, r, {k: [round(m[k], 2) for m in rows] for k in keys}, flush=True)
    for kind, per in figures.items():
        for k, v in per.items():
            print(
                f"{kind:9s} {k:16s} median {statistics.median(v):7.2f} s  min {min(v):7.2f}  max {max(v):7.2f}  n={len(v)}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["parity", "demo"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    if a.what == "parity":
        parity(a.dtype, a.prompts, a.samples)
    else:
        demo(a.repeats, a.steps)


if __name__ == "__main__":
    main()
