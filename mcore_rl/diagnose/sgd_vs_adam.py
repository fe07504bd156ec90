"""`adam_effective_lr`: the distribution of AdamW's per-coordinate learning rate in a checkpoint, which
is how SGD-vs-Adam-RLVR ("Do We Need Adam?", arXiv:2602.07729) sets the SGD learning rate (`optimizer.name:
sgd`, about 10^5 x AdamW's nominal rate: 1e-1 against 1e-6).

    η_eff = η / (√v̂ + ε),   v̂ = v / (1 − β₂^t)   (v: AdamW's second moment `exp_avg_sq`, t: its step)

The paper reports η_eff spanning 1e-1 to 1e2 with most mass in 1e0–1e1 for η = 1e-6 ... so the
ratio to the nominal rate, not the value, is what carries over. The notes do not say which
statistic of the distribution the SGD rate was read from; this reports quantiles and the mass per
decade, and suggests the median (`suggested_sgd_lr`). v̂ is bias-corrected as torch's AdamW does
(`--no-bias-correction` for the raw formula). The update-sparsity and effective-rank measurements
of the same paper are `mcore-rl diagnose update_sparsity`.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from mcore_rl.diagnose import Runner, analysis
from mcore_rl.diagnose.update_sparsity import dist_checkpoint_path, module_type

_PREFIX = "optimizer.state.exp_avg_sq."


def effective_lr(
    exp_avg_sq: torch.Tensor, lr: float, eps: float, step: int = 0, beta2: float = 0.0, bias_correction: bool = True
) -> torch.Tensor:
    """η / (√v̂ + ε) per coordinate, float64; v̂ = v / (1 − β₂^step) when bias-corrected (step ≥ 1)."""
    v = exp_avg_sq.double()
    if bias_correction:
        if step < 1:
            raise ValueError(f"bias correction needs the optimizer step (>= 1), got {step}")
        v = v / (1.0 - beta2**step)
    return lr / (v.sqrt() + eps)


def quantiles(x: torch.Tensor, qs: tuple[float, ...] = (0.01, 0.1, 0.5, 0.9, 0.99)) -> dict[str, float]:
    """Named quantiles (`q50` is the median) of a flat tensor (linear interpolation)."""
    flat = x.double().flatten()
    if flat.numel() > 16_000_000:  # torch.quantile's limit: an even subsample is exact enough for a summary
        flat = flat[:: math.ceil(flat.numel() / 16_000_000)]
    values = torch.quantile(flat, torch.tensor(qs, dtype=torch.float64))
    return {f"q{q * 100:g}": float(v) for q, v in zip(qs, values)}


def decade_mass(x: torch.Tensor) -> dict[str, float]:
    """The share of coordinates per power of ten: key `1e{k}` holds values in [10^k, 10^(k+1))."""
    flat = x.double().flatten()
    flat = flat[flat > 0]
    if not flat.numel():
        return {}
    k = torch.floor(torch.log10(flat)).long()
    ks, counts = torch.unique(k, return_counts=True)
    return {f"1e{int(a)}": int(c) / flat.numel() for a, c in zip(ks, counts)}


def _optimizer_common(path: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing  # the common state only: no world needed

    opt = dist_checkpointing.load_common_state_dict(path).get("optimizer")
    if not isinstance(opt, dict) or "optimizer" not in opt:
        raise ValueError(f"{path} holds no optimizer state (a model-only checkpoint?)")
    if opt.get("name", "adamw") != "adamw":
        raise ValueError(f"{path} was written by optimizer.name={opt['name']}, which has no second moments")
    return opt


def read_second_moments(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`exp_avg_sq` by parameter name, and {lr, eps, beta2, step} from an AdamW dist-checkpoint."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = dist_checkpoint_path(path)
    opt = _optimizer_common(path)
    meta = FileSystemReader(path).read_metadata()
    moments = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.startswith(_PREFIX)
    }
    if not moments:
        raise ValueError(f"{path} has no {_PREFIX}* tensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load(moments, checkpoint_id=path, no_dist=True)
    group = opt["optimizer"]["param_groups"][0]
    hyper = {
        "lr": float(opt["scheduler"]["max_lr"]),
        "eps": float(group["eps"]),
        "beta2": float(group["betas"][1]),
        "step": int(opt["optimizer"]["state"].get("common_step", 0)),
    }
    return {k[len(_PREFIX) :]: v for k, v in moments.items()}, hyper


def summarize(
    moments: dict[str, torch.Tensor], lr: float, eps: float, step: int, beta2: float, bias_correction: bool = True
) -> dict[str, Any]:
    """Quantiles and decade mass of η_eff overall, the median per module type, and the suggestion."""
    per_type: dict[str, list[torch.Tensor]] = {}
    for name, v in sorted(moments.items()):
        per_type.setdefault(module_type(name), []).append(
            effective_lr(v, lr, eps, step, beta2, bias_correction).flatten()
        )
    everything = torch.cat([t for ts in per_type.values() for t in ts])
    overall = quantiles(everything)
    return {
        "nominal_lr": lr,
        "step": step,
        "overall": overall,
        "decade_mass": decade_mass(everything),
        "by_module": [
            {"module": k, "params": sum(t.numel() for t in ts), **quantiles(torch.cat(ts), (0.1, 0.5, 0.9))}
            for k, ts in sorted(per_type.items())
        ],
        "suggested_sgd_lr": overall["q50"],
        "suggested_ratio": overall["q50"] / lr if lr > 0 else math.inf,
    }


@analysis(
    "adam_effective_lr",
    "AdamW's effective per-coordinate LR lr/(sqrt(v)+eps) in a checkpoint: the "
    "distribution SGD-vs-Adam-RLVR sets optimizer.name=sgd's lr from",
)
def add_arguments(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("checkpoint", help="a megatron save dir / iter_* dir written with optimizer.name=adamw")
    p.add_argument("--lr", type=float, default=None, help="nominal η (default: the checkpoint's optimizer.lr)")
    p.add_argument("--no-bias-correction", action="store_true", help="use v, not v / (1 - beta2^t)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        moments, hyper = read_second_moments(args.checkpoint)
        lr: float | None = args.lr if args.lr is not None else hyper["lr"]
        if lr is None:
            raise ValueError(f"{args.checkpoint}: no learning rate recorded; pass --lr")
        return {
            "checkpoint": args.checkpoint,
            **summarize(moments, lr, hyper["eps"], hyper["step"], hyper["beta2"], not args.no_bias_correction),
        }

    return run
