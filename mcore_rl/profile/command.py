"""`mcore-rl profile`: read the inputs, enumerate and estimate layouts, rank them, measure on request.

    mcore-rl profile MODEL [model.key=value ...] --cluster h100_sxm [--nodes N] [--global-batch 256]
        [--micro-batch 1] [--seq-length 4096] [--precision bf16] [--recompute none|selective|full]
        [--distributed-optimizer] [--layout tp=2,pp=2] [--top 10] [--json PATH]
        [--rollout-prompts P --samples-per-prompt G --prompt-length L --response-length R [--sync]]
        [--measure [--measure-top K]]

MODEL is a recipe YAML (its `model:` section is used), an HF checkpoint directory or its
`config.json`. Layouts are ranked by estimated step time among those that fit in GPU memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import yaml

from mcore_rl.config.errors import ConfigError
from mcore_rl.config.loader import config_to_dict
from mcore_rl.config.schema import ModelConfig
from mcore_rl.models.flops import mfu, train_flops_per_token
from mcore_rl.profile import cluster as cluster_mod
from mcore_rl.profile.layouts import (
    Layout,
    TrainShape,
    candidate_layouts,
    check_layout,
    enumerate_layouts,
    parse_layout,
)
from mcore_rl.profile.memory import (
    GiB,
    activations,
    check_supported,
    kv_cache_bytes_per_token,
    model_state,
    stage_activations,
)
from mcore_rl.profile.report import SCHEMA_VERSION, format_layouts, format_measured, format_split
from mcore_rl.profile.timing import step_time
from mcore_rl.config import RLConfig, SFTConfig, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="recipe YAML (its model: section), HF checkpoint dir, or config.json")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe's model, e.g. model.num_layers=4")
    p.add_argument("--cluster", default="h100_sxm", help=f"preset ({', '.join(cluster_mod.PRESETS)}) or YAML file")
    p.add_argument("--nodes", type=int, help="override the cluster's node count")
    p.add_argument("--gpus-per-node", type=int, help="override the cluster's GPUs per node")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the recipe's, else 256)")
    p.add_argument("--micro-batch", type=int, help="default: the recipe's, else 1")
    p.add_argument("--seq-length", type=int, help="default: the recipe's, else 4096")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="default: the recipe's, else bf16")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], help="default: the recipe's, else adamw")
    p.add_argument("--recompute", choices=["none", "selective", "full"], help="default: the recipe's, else none")
    p.add_argument("--distributed-optimizer", action="store_true", help="rank by memory with ZeRO-1 sharding")
    p.add_argument("--layout", help="estimate only this layout, e.g. tp=2,pp=2,vpp=2,ep=4 (checked like the trainer)")
    p.add_argument("--top", type=int, default=10, help="layouts to print")
    p.add_argument("--json", help="also write everything to this JSON file; `-`: only the JSON, to standard output")
    p.add_argument(
        "--colocated-kv-tokens",
        type=int,
        default=0,
        help="tokens of KV cache a colocated engine keeps on each trainer GPU (added to memory)",
    )
    p.add_argument("--rollout-prompts", type=int, default=0, help="RL: prompts per step (enables the split)")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=512)
    p.add_argument("--response-length", type=int, default=4096)
    p.add_argument("--sync", action="store_true", help="RL: rollout and training alternate (default: asynchronous)")
    p.add_argument("--measure", action="store_true", help="run real steps of the top layouts here and compare")
    p.add_argument("--measure-top", type=int, default=2)
    p.add_argument("--measure-steps", type=int, default=2)


DEFAULT_SHAPE = TrainShape()  # without a recipe (an HF checkpoint): 256 x 4096 tokens, bf16


def load_model(source: str, overrides: list[str]) -> tuple[ModelConfig, str, TrainShape]:
    """The model of a recipe (SFT or RL, chosen by its sections) or of an HF config, and the training
    shape it runs with (`DEFAULT_SHAPE` for an HF config or a recipe that sets no `train:` value);
    ConfigError otherwise."""
    if os.path.isdir(source) or os.path.basename(source) == "config.json":
        from mcore_rl.convert import model_config_from_hf, read_hf_config  # lazy: transformers

        directory = source if os.path.isdir(source) else os.path.dirname(source) or "."
        try:
            model = model_config_from_hf(read_hf_config(directory))
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"{source}: {err}") from None
        return model, os.path.basename(os.path.abspath(directory)), DEFAULT_SHAPE

    if not os.path.isfile(source):
        raise ConfigError(f"model: {source!r} is neither a recipe file, an HF checkpoint directory nor a config.json")
    with open(source) as f:
        raw = yaml.safe_load(f) or {}
    name = os.path.splitext(os.path.basename(source))[0]
    if isinstance(raw, dict) and ({"rollout", "algorithm", "init"} & set(raw)):
        rl = load_config(RLConfig, source, overrides)
        return rl.model, name, recipe_shape_rl(rl) if rl.train != RLConfig().train else DEFAULT_SHAPE
    sft = load_config(SFTConfig, source, overrides)
    t = sft.train
    if t == SFTConfig().train:  # a model-only recipe (configs/profile_*.yaml): its training shape is not its own
        return sft.model, name, DEFAULT_SHAPE
    return (
        sft.model,
        name,
        TrainShape(t.global_batch_size, t.micro_batch_size, t.seq_length, t.precision, sft.optimizer.name, t.recompute),
    )


def recipe_shape_rl(cfg: RLConfig) -> TrainShape:
    """An RL recipe's learner shape: rows of `train.seq_length`, and per optimizer step as many rows
    as the step has samples (an upper bound: short samples are packed several to a row), rounded up
    to whole micro-batches."""
    t, r = cfg.train, cfg.rollout
    samples = -(-r.prompts_per_step * r.group_size // cfg.algorithm.num_minibatches)
    rows = -(-samples // t.micro_batch_size) * t.micro_batch_size
    return TrainShape(rows, t.micro_batch_size, t.seq_length, t.precision, cfg.optimizer.name, t.recompute)


def train_shape(args: argparse.Namespace, recipe: TrainShape) -> TrainShape:
    """The shape to estimate: each flag given on the command line, else the recipe's value."""
    given = {
        "global_batch_size": args.global_batch,
        "micro_batch_size": args.micro_batch,
        "seq_length": args.seq_length,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "recompute": args.recompute,
    }
    return dataclasses.replace(
        recipe, distributed_optimizer=args.distributed_optimizer, **{k: v for k, v in given.items() if v is not None}
    )


def _estimate(
    model: ModelConfig,
    layout: Layout,
    shape: TrainShape,
    cluster: cluster_mod.ClusterSpec,
    attention: str,
    kv_tokens: int,
) -> dict[str, Any]:
    m = shape.global_batch_size // (shape.micro_batch_size * layout.dp)
    plain = dataclasses.replace(shape, distributed_optimizer=False)
    states = [model_state(model, layout, plain, r) for r in sorted({0, layout.pp - 1})]
    dist = [
        model_state(model, layout, dataclasses.replace(shape, distributed_optimizer=True), r)
        for r in sorted({0, layout.pp - 1})
    ]
    state = max(states, key=lambda s: s.total)
    act = activations(model, layout, shape, m, attention)
    kv = kv_tokens * kv_cache_bytes_per_token(model, layout.tp)
    optimizer = max(d.optimizer for d in dist) if shape.distributed_optimizer else state.optimizer
    total = state.params + state.grads + optimizer + act.total + kv
    t = step_time(model, layout, shape, cluster, m)
    tokens_per_gpu_s = shape.global_batch_size * shape.seq_length / t.total_s / layout.world_size
    return {
        "layout": layout.name(),
        "parallel": dataclasses.asdict(layout),
        "num_microbatches": m,
        "memory": {
            "params": state.params,
            "grads": state.grads,
            "optimizer": state.optimizer,
            "optimizer_distributed": max(d.optimizer for d in dist),
            "activations": act.total,
            "activations_per_layer": act.per_layer,
            "layers_in_flight": act.layers_in_flight,
            "kv_cache": kv,
            "total": total,
            "by_stage": [dataclasses.asdict(s) for s in states],
        },
        "fits": total <= cluster.gpu_memory_gb * GiB,
        "time": t.as_dict(),
        "tokens_per_gpu_s": tokens_per_gpu_s,
        "mfu": mfu(
            tokens_per_gpu_s,
            train_flops_per_token(model, shape.seq_length),  # model FLOPs: no recompute
            cluster.peak_flops(shape.precision),
        ),
    }


def rank(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Layouts that fit first, fastest first; among equals the smaller memory."""
    return sorted(rows, key=lambda r: (not r["fits"], r["time"]["total_s"], r["memory"]["total"]))


def profile(args: argparse.Namespace) -> dict[str, Any]:
    model, model_name, recipe_shape = load_model(args.model, args.overrides)
    shape = train_shape(args, recipe_shape)
    check_supported(model)
    cluster = cluster_mod.load_cluster(args.cluster, {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node})
    calibration: dict[str, float] | None = None
    if args.measure:
        from mcore_rl.profile.measure import calibrate_cpu  # lazy: torch

        import torch

        if not torch.cuda.is_available():  # rank layouts by this CPU's real matmul rate
            from mcore_rl.profile.measure import model_matmul  # lazy: torch

            calibration = calibrate_cpu(
                *model_matmul(model, TrainShape(shape.global_batch_size, shape.micro_batch_size, shape.seq_length))
            )
            cluster = dataclasses.replace(
                cluster,
                peak_tflops_fp32=calibration["fp32"] / 1e12,
                peak_tflops_bf16=calibration["bf16"] / 1e12,
                compute_efficiency=1.0,
            )
    attention = "flash" if cluster.has_transformer_engine else "local"
    world = cluster.world_size
    if args.layout:
        layout = parse_layout(args.layout, world)
        check_layout(model, layout, shape, cluster.has_transformer_engine)  # the trainer's ConfigError
        layouts, candidates = [layout], 1
    else:
        check_layout(
            model,
            Layout(dp=1),
            dataclasses.replace(shape, global_batch_size=shape.micro_batch_size),
            cluster.has_transformer_engine,
        )  # a model the trainer rejects fails here, naming the key
        candidates = sum(1 for _ in candidate_layouts(model, world, cluster.gpus_per_node))
        layouts = enumerate_layouts(model, world, cluster.gpus_per_node, shape, cluster.has_transformer_engine)
        if not layouts:
            raise ConfigError(
                f"no layout of {world} GPUs is valid for this model and batch (--global-batch "
                f"{shape.global_batch_size}, --micro-batch {shape.micro_batch_size}); try another batch"
            )
    rows = rank([_estimate(model, lay, shape, cluster, attention, args.colocated_kv_tokens) for lay in layouts])
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "model_name": model_name,
        "model": config_to_dict(model),
        "cluster": dataclasses.asdict(cluster),
        "shape": dataclasses.asdict(shape),
        "attention_kernel": attention,
        "num_candidates": candidates,
        "num_valid_layouts": len(layouts),
        "layouts": rows,
        "cpu_calibration_flops": calibration,
    }
    if args.rollout_prompts:
        # the split runs the asynchronous scheduler's simulator, whose package imports torch: only when asked
        from mcore_rl.profile.split import RolloutTarget, recommend_split, split_dict

        target = RolloutTarget(
            args.rollout_prompts,
            args.samples_per_prompt,
            args.prompt_length,
            args.response_length,
            asynchronous=not args.sync,
        )

        def best_layout_for(n: int, train_shape: TrainShape):
            sub = dataclasses.replace(
                cluster, nodes=max(1, n // cluster.gpus_per_node), gpus_per_node=min(n, cluster.gpus_per_node)
            )
            valid = enumerate_layouts(model, n, sub.gpus_per_node, train_shape, cluster.has_transformer_engine)
            est = rank([_estimate(model, lay, train_shape, sub, attention, 0) for lay in valid])
            est = [r for r in est if r["fits"]]
            return (est[0]["layout"], est[0]["time"]["total_s"]) if est else None

        result["rl_split"] = [split_dict(s) for s in recommend_split(model, cluster, shape, target, best_layout_for)]
        result["rollout_target"] = dataclasses.asdict(target)
    if args.measure:
        result["measured"] = measure_top(model, layouts, rows, shape, cluster, args.measure_top, args.measure_steps)
    return result


def measure_top(
    model: ModelConfig,
    layouts: list[Layout],
    rows: list[dict[str, Any]],
    shape: TrainShape,
    cluster: cluster_mod.ClusterSpec,
    top: int,
    steps: int,
) -> list[dict[str, Any]]:
    from mcore_rl.profile.measure import measure_layouts  # lazy: torch

    by_name = {lay.name(): lay for lay in layouts}
    chosen = [by_name[r["layout"]] for r in rows[:top]]
    measured = measure_layouts(model, chosen, shape, steps)
    out = []
    for lay, row, got in zip(chosen, rows, measured):
        m = row["num_microbatches"]
        stages = []
        for pp_rank, st in sorted(got["stages"].items()):
            est = model_state(model, lay, shape, pp_rank)
            est_act = stage_activations(model, lay, shape, m, pp_rank, "local").total
            meas = {**st["state"], "activation_peak": st["activation_peak"]}
            exact = (meas["params"], meas["grads"], meas["optimizer"]) == (est.params, est.grads, est.optimizer)
            stages.append(
                {
                    "pp_rank": pp_rank,
                    "measured": meas,
                    "estimated": {**dataclasses.asdict(est), "activations": est_act},
                    "model_state_exact": exact,
                    "activation_ratio": est_act / max(st["activation_peak"], 1),
                }
            )
        estimated = row["time"]["total_s"]
        if got["matmul_flops"]:  # CPU: the estimate at the matmul rate the ranks had while they were timed
            field = "peak_tflops_bf16" if shape.precision == "bf16" else "peak_tflops_fp32"
            at_rate = dataclasses.replace(cluster, **{field: got["matmul_flops"] / 1e12})
            estimated = step_time(model, lay, shape, at_rate, m).total_s
        out.append(
            {
                "layout": lay.name(),
                "stages": stages,
                "step_s_measured": got["step_s"],
                "matmul_flops_measured": got["matmul_flops"],
                "step_s_estimated": estimated,
                "step_time_ratio": estimated / max(got["step_s"], 1e-12),
            }
        )
    return out


def run(args: argparse.Namespace) -> str:
    """The report as text (and the JSON file when asked); with `--json -` the JSON alone."""
    result = profile(args)
    if args.json == "-":
        return json.dumps(result, indent=1, default=float)
    shown = dict(result, layouts=result["layouts"][: args.top])
    text = [format_layouts(shown)]
    if "rl_split" in result:
        text.append(format_split(result["rl_split"], args.top))
    if "measured" in result:
        text.append(format_measured(result["measured"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
        text.append(f"wrote {args.json}")
    return "\n\n".join(text)
