"""Benchmark: wall time and peak RSS per rank of `mcore-rl convert`, vs model size and rank count.

Makes Qwen3-style checkpoints with random bf16 weights here (written tensor by tensor, never a whole
model in memory), then runs hf-to-mcore and mcore-to-hf with 1, 2 and 4 ranks (TP and PP). Each
rank is a process of its own (this script with --worker) that reports its peak RSS (VmHWM); the table
gives the max and median over ranks, the peak over the largest tensor and over the model's bytes.
`--old-root DIR` (another checkout) also runs the exporter/importer of another checkout (PYTHONPATH) on the
sizes in `--old-sizes`, for comparison. The `dsv3-*` sizes are DeepSeek-V3-shaped checkpoints as
released: block-scaled FP8 linear weights (128 x 128 blocks, dequantized on import), YaRN and one
MTP layer (carried through), convertible in the `ep2` layout too.

    python benchmarks/bench_convert.py --work-dir /tmp/bench_convert [--sizes 250m,1b] [--old-root DIR]

Disk: the source (bf16), the megatron checkpoint (bf16) and one export at a time: < 6 GB for 1b.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Qwen3-style shapes (GQA 16/8 heads, QK-norm, untied output layer); vocabulary 32768.
SIZES = {
    "250m": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=18,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
# DeepSeek-V3 shapes (MLA, 32 routed experts in 4 groups, one shared, first layer dense, one MTP layer)
DSV3_SIZES = {
    "dsv3-300m": dict(
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_attention_heads=8,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
    ),
    "dsv3-1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1024,
        num_attention_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
}
FP8_BLOCK = 128
# (ranks, layout name, --tp, --pp); ep2 below
LAYOUTS = [
    (1, "tp1", 1, 1),
    (2, "tp2", 2, 1),
    (2, "pp2", 1, 2),
    (4, "tp4", 4, 1),
    (4, "tp2pp2", 2, 2),
    (2, "ep2", 1, 1),
]
EXPERT_PARALLEL = {"ep2": 2}


def make_dsv3_checkpoint(size: str, out: str) -> dict:
    """A random DeepSeek-V3-shaped checkpoint as released (FP8 blocks, YaRN, an MTP layer), in shards
    of 500 MB, written one tensor at a time; the counts are of the dequantized (bf16) model."""
    import torch
    from transformers import DeepseekV3Config

    from mcore_rl.convert.stream_export import SafetensorsShardWriter, natural_key
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.hf.configuration import model_config_from_hf_config

    layers = 4
    fields: dict[str, Any] = dict(
        vocab_size=32768,
        num_hidden_layers=layers,
        num_key_value_heads=DSV3_SIZES[size]["num_attention_heads"],
        n_shared_experts=1,
        n_routed_experts=32,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        rope_theta=10000,
        num_nextn_predict_layers=1,
        bos_token_id=0,
        eos_token_id=1,
        **DSV3_SIZES[size],
    )
    cfg = DeepseekV3Config.from_dict(fields)
    with torch.device("meta"):  # our reference model has the checkpoint's (per-expert) names
        model = McoreRLForCausalLM(hf_config_from_model_config(model_config_from_hf_config(cfg)))
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mtp = {
        k.replace(f"layers.{layers - 1}.", f"layers.{layers}."): v
        for k, v in shapes.items()
        if f"layers.{layers - 1}." in k
    }
    h = cfg.hidden_size
    mtp |= {f"model.layers.{layers}.{n}.weight": (h,) for n in ("enorm", "hnorm", "shared_head.norm")}
    mtp[f"model.layers.{layers}.eh_proj.weight"] = (h, 2 * h)
    shapes |= mtp

    def quantized(name: str) -> bool:
        return len(shapes[name]) == 2 and name.endswith("proj.weight")

    def scale_shape(name: str) -> tuple[int, int]:
        rows, cols = shapes[name]
        return -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)

    plan = []
    for name in sorted(shapes, key=natural_key):
        if quantized(name):
            plan += [(name, shapes[name], torch.float8_e4m3fn), (name + "_scale_inv", scale_shape(name), torch.float32)]
        else:
            dtype = torch.float32 if name.endswith(("mlp.gate.weight", "e_score_correction_bias")) else torch.bfloat16
            plan.append((name, shapes[name], dtype))
    os.makedirs(out, exist_ok=True)
    writer = SafetensorsShardWriter(out, plan, 500 * 1024**2)
    gen = torch.Generator().manual_seed(0)
    for name, shape, dtype in plan:
        if name.endswith("_scale_inv"):
            t = torch.full(shape, shapes[name[: -len("_scale_inv")]][1] ** -0.5 / 448 * 3)
        elif len(shape) == 1:
            t = torch.ones(shape) if not name.endswith("e_score_correction_bias") else torch.zeros(shape)
        elif dtype == torch.float8_e4m3fn:
            t = (torch.randn(shape, generator=gen) * 448 / 3).clamp(-448, 448)
        else:
            t = torch.randn(shape, generator=gen) * shape[1] ** -0.5
        writer.write(name, t.to(dtype))
    writer.close()
    cfg.quantization_config = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    cfg.save_pretrained(out)
    params = sum(math.prod(s) for s in shapes.values())
    return {"params": params, "bytes": 2 * params, "largest_bytes": 2 * max(math.prod(s) for s in shapes.values())}


def make_checkpoint(size: str, out: str) -> dict:
    """A random bf16 Qwen3 checkpoint in shards of 500 MB, written one tensor at a time."""
    if size in DSV3_SIZES:
        return make_dsv3_checkpoint(size, out)
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from mcore_rl.convert.stream_export import SafetensorsShardWriter, natural_key

    cfg = Qwen3Config(
        vocab_size=32768,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **SIZES[size],
    )
    cfg.dtype = torch.bfloat16
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    os.makedirs(out, exist_ok=True)
    names = sorted(shapes, key=natural_key)
    writer = SafetensorsShardWriter(out, [(n, shapes[n], torch.bfloat16) for n in names], 500 * 1024**2)
    gen = torch.Generator().manual_seed(0)
    for name in names:
        if len(shapes[name]) == 1:
            t = torch.ones(shapes[name])
        else:
            t = torch.randn(shapes[name], generator=gen) * shapes[name][1] ** -0.5
        writer.write(name, t.to(torch.bfloat16))
    writer.close()
    cfg.save_pretrained(out)
    params = sum(math.prod(s) for s in shapes.values())
    return {"params": params, "bytes": 2 * params, "largest_bytes": 2 * max(math.prod(s) for s in shapes.values())}


def worker(args: argparse.Namespace) -> None:
    """One rank: convert, then write this process's peak RSS (and the streaming counters, if any)."""
    import warnings

    warnings.filterwarnings("ignore")
    from mcore_rl.convert import hf_to_mcore, mcore_to_hf, parallel_config
    from mcore_rl.parallel import setup

    import megatron.core.models.gpt  # noqa: F401  (in the baseline: every rank pays for these imports)
    import transformers  # noqa: F401  (as above)

    from mcore_rl.convert import to_hf, to_mcore
    from mcore_rl.models import shards
    from mcore_rl.train import checkpoint

    pc = parallel_config(args.tp, args.pp, args.ep)
    setup.init_distributed()
    base = _max_rss()
    marks: dict[str, int] = {}
    # peak RSS when each phase ends: the model built, the weights in, the checkpoint written / read
    for module, attr, label in [
        (to_mcore, "build_chunks", "built"),
        (to_hf, "build_chunks", "built"),
        (to_mcore, "stream_load", "weights_in"),
        (shards, "load_full_state_dict", "weights_in"),
        (checkpoint, "load_checkpoint", "weights_in"),
    ]:
        _mark_after(module, attr, label, marks)
    start = time.perf_counter()
    if args.direction == "import":
        hf_to_mcore(args.input, args.output, pc, "bf16")
    else:
        mcore_to_hf(args.input, args.output, pc, max_shard_bytes=1024**3)
    wall = time.perf_counter() - start
    with open(f"{args.report}.{os.environ['RANK']}", "w") as f:
        json.dump({"wall": wall, "peak": _max_rss(), "base": base, **marks}, f)
    setup.destroy()


def _max_rss() -> int:
    """This process's peak RSS in bytes: VmHWM (of this address space; `ru_maxrss` would carry the
    launching process's peak over fork + exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mark_after(module, attr: str, label: str, marks: dict) -> None:
    """Record this process's peak RSS when `module.attr` returns (a measurement hook, nothing else)."""
    fn = getattr(module, attr, None)
    if fn is None:  # e.g. the old importer has no stream_load
        return

    def measured(*args, **kwargs):
        out = fn(*args, **kwargs)
        marks[label] = _max_rss()
        return out

    setattr(module, attr, measured)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    root: str, ranks: int, tp: int, pp: int, direction: str, src: str, dst: str, report: str, ep: int = 1
) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=root,
        WORLD_SIZE=str(ranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS="1",
        MCORE_RL_PROGRESS="0",
        PYTHONWARNINGS="ignore",
    )
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--direction",
        direction,
        "--input",
        src,
        "--output",
        dst,
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--ep",
        str(ep),
        "--report",
        report,
    ]
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            cmd,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    errors = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - start
    for p, err in zip(procs, errors):
        if p.returncode:
            return {"error": f"rank exited {p.returncode}: {err[-1500:]}"}
    reports = [json.load(open(f"{report}.{r}")) for r in range(ranks)]
    got = {"wall": wall, "peaks": [r["peak"] for r in reports], "bases": [r["base"] for r in reports]}
    for label in ("built", "weights_in"):
        got[label] = [r.get(label, 0) for r in reports]
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default="/tmp/bench_convert")
    p.add_argument("--sizes", default="250m,1b")
    p.add_argument("--layouts", default=",".join(name for _, name, _, _ in LAYOUTS))
    p.add_argument("--old-root", default=None, help="another checkout whose converter to run for comparison")
    p.add_argument("--old-sizes", default="250m")
    p.add_argument("--old-layouts", default="tp1,tp2")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("direction", "input", "output", "report"):
        p.add_argument(f"--{flag}", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, ROOT)
    rows = []
    layouts = {name: (ranks, tp, pp) for ranks, name, tp, pp in LAYOUTS}
    old_sizes = args.old_sizes.split(",") if args.old_root else []
    made: dict[str, dict] = {}
    for size in args.sizes.split(","):
        work = os.path.join(args.work_dir, size)
        made[size] = info = make_checkpoint(size, os.path.join(work, "hf"))
        print(
            f"{size}: {info['params'] / 1e6:.0f}M parameters, {info['bytes'] / 2**30:.2f} GiB bf16, "
            f"largest tensor {info['largest_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
        runs = [("new", ROOT, name) for name in args.layouts.split(",") if name]
        runs += [("old", args.old_root, name) for name in args.old_layouts.split(",") if size in old_sizes]
        for code, root, name in runs:
            ranks, tp, pp = layouts[name]
            for direction in ("import", "export"):
                src, dst = {"import": (f"{work}/hf", f"{work}/mcore"), "export": (f"{work}/mcore", f"{work}/export")}[
                    direction
                ]
                for stale in ([dst] if direction == "import" else []) + [f"{work}/export"]:
                    shutil.rmtree(stale, ignore_errors=True)
                ep = EXPERT_PARALLEL.get(name, 1)
                got = run_ranks(root, ranks, tp, pp, direction, src, dst, f"{work}/report", ep)
                row = {
                    "code": code,
                    "size": size,
                    "params": info["params"],
                    "ranks": ranks,
                    "layout": name,
                    "direction": direction,
                    **got,
                }
                rows.append(row)
                print(_format(row, info), flush=True)
        shutil.rmtree(work, ignore_errors=True)  # one model on disk at a time
    print("\n" + _table(rows, made))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _format(row: dict, info: dict) -> str:
    if "error" in row:
        return f"{row['code']} {row['size']} {row['layout']} {row['direction']}: FAILED {row['error']}"
    gib = 2**30
    peak, median = max(row["peaks"]), statistics.median(row["peaks"])
    built, weights = max(row.get("built", [0])), max(row.get("weights_in", [0]))
    return (
        f"| {row['code']} | {info['params'] / 1e6:.0f}M | {row['ranks']} | {row['layout']} | {row['direction']} | "
        f"{row['wall']:.0f} | {peak / gib:.2f} | {median / gib:.2f} | {max(row['bases']) / gib:.2f} | "
        f"{built / gib:.2f} | {weights / gib:.2f} | "
        f"{peak / info['largest_bytes']:.1f} | {peak / info['bytes']:.2f} |"
    )


def _table(rows: list[dict], made: dict) -> str:
    head = (
        "| code | model | ranks | layout | direction | wall s | peak RSS/rank max GiB | median GiB | "
        "after imports | model built | weights in | peak / largest tensor | peak / model bytes |\n" + "|---" * 13 + "|"
    )
    return head + "\n" + "\n".join(_format(r, made[r["size"]]) for r in rows)


if __name__ == "__main__":
    main()
