"""`update_sparsity`: how sparse, how low-rank and where an update is, from two checkpoints of a run.

OPD-Sparsity ("Dense Supervision, Sparse Updates", NJU & Alibaba 2026, arXiv:2606.13657) measures
the delta ΔW = W_trained − W_src of on-policy distillation: tiny, coordinate-sparse, concentrated in
the FFN, numerically full-rank but spectrally concentrated, away from the source weights' principal
subspace and on coordinates where the source weight is near zero. SGD-vs-Adam-RLVR ("Do We Need
Adam?", arXiv:2602.07729) measures its SGD updates the same way: sparsity = 1 − ‖θ¹ − θ⁰‖₀ / n with
the ℓ0 threshold 1e-5, and the effective rank (singular values holding 99% of the spectral energy) averaged over the
2-D weights. Both are here, each quantity a function of tensors, computed in float32 (singular
values in float64, so that "k equal singular values" stays exact enough to count).

Choices where the summary is unclear (docs/design.md#paper-methods):
* c_p's p is not given: `--top-p` defaults to 1% of the coordinates (⌈p·n⌉ of them).
* M_prin, the "principal-coordinate mask", is not defined: here the 10% of coordinates (the same
  size as M_low) with the largest |entry| of the source's rank-k approximation U_k Σ_k V_kᵀ, k = the
  10% rank fraction.
* A tensor with more than two dimensions (megatron's stacked layers [L, out, in], experts) counts as
  a stack of matrices: spectral numbers are averaged over the matrices, coordinate numbers pooled.
* megatron's fused matrices (linear_qkv = [q;k;v], linear_fc1 = [gate;up]) are analysed as stored.
* Masked (subnetwork) retraining: `--write-mask` saves m = 1{|θ_full − θ_0| > τ} (τ: `--mask-tau`,
  not given by the paper; 1e-5 here) for `optimizer.update_mask`, which trains only those coordinates.

Checkpoints are megatron dist-checkpoints as `train/checkpoint.py` writes them (a save dir or one
`iter_*` dir: read in one process, no world) or Hugging Face safetensors dirs.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import warnings
from typing import Any

import torch

from mcore_rl.diagnose import Runner, analysis
from mcore_rl.train.checkpoint import latest_checkpoint

# ------------------------------------------------------------------- coordinate quantities


def delta(trained: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """ΔW = W_trained − W_src in float32."""
    if trained.shape != source.shape:
        raise ValueError(f"shapes differ: trained {tuple(trained.shape)} vs source {tuple(source.shape)}")
    return trained.float() - source.float()


def relative_norm(d: torch.Tensor, source: torch.Tensor) -> float:
    """r = ‖ΔW‖_F / ‖W_src‖_F (inf for a zero source with a non-zero delta)."""
    num, den = float(d.float().norm()), float(source.float().norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def visible(d: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The coordinates an update visibly changed: |ΔW_i| > ε."""
    return d.float().abs() > eps


def sparsity(d: torch.Tensor, eps: float = 1e-5) -> float:
    """s_ε = |{i : |ΔW_i| ≤ ε}| / |ΔW| — OPD's visible sparsity, and SGD-vs-Adam's 1 − ‖Δθ‖₀/n."""
    n = d.numel()
    return 1.0 - int(visible(d, eps).sum()) / n if n else 1.0


def top_energy(d: torch.Tensor, p: float) -> float:
    """c_p: the share of ‖ΔW‖_F² held by the ⌈p·n⌉ largest |ΔW_i| (1 for a zero delta)."""
    if not 0 < p <= 1:
        raise ValueError(f"top-p fraction must be in (0, 1], got {p}")
    sq = d.float().flatten().square()
    total = float(sq.sum())
    if total == 0:
        return 1.0
    k = min(sq.numel(), math.ceil(p * sq.numel()))
    return float(sq.topk(k).values.sum()) / total


# ------------------------------------------------------------------- spectral quantities


def _as_matrices(t: torch.Tensor) -> list[torch.Tensor]:
    """A 2-D tensor, or every matrix of a stack ([L, out, in], [L, E, out, in]); [] for 1-D."""
    if t.ndim < 2:
        return []
    return list(t.float().reshape(-1, t.shape[-2], t.shape[-1]))


def singular_values(m: torch.Tensor) -> torch.Tensor:
    """σ₁ ≥ σ₂ ≥ … of a float32 matrix, computed in float64."""
    return torch.linalg.svdvals(m.float().double())


def spectral_energy(m: torch.Tensor, k: int = 16) -> float:
    """e_k = Σ_{i<k} σ_i² / Σ_i σ_i² (1 for a zero matrix)."""
    s2 = singular_values(m).square()
    total = float(s2.sum())
    return float(s2[:k].sum()) / total if total > 0 else 1.0


def stable_rank(m: torch.Tensor) -> float:
    """srank = ‖ΔW‖_F² / ‖ΔW‖₂² (0 for a zero matrix)."""
    s = singular_values(m)
    return float(s.square().sum() / s[0].square()) if len(s) and s[0] > 0 else 0.0


def numerical_rank(m: torch.Tensor, tau: float = 1e-5) -> int:
    """rank_τ = |{i : σ_i > τ·σ₁}| (0 for a zero matrix)."""
    s = singular_values(m)
    return int((s > tau * s[0]).sum()) if len(s) and s[0] > 0 else 0


def effective_rank(m: torch.Tensor, energy: float = 0.99) -> int:
    """SGD-vs-Adam's effective rank: the fewest singular values whose σ² hold `energy` of the total
    (k equal ones give ⌈energy·k⌉). A relative slack of 1e-9 absorbs float64 rounding of the sums."""
    s2 = singular_values(m).square()
    total = float(s2.sum())
    if total == 0:
        return 0
    cum = torch.cumsum(s2, 0) / total
    return int((cum < energy - 1e-9).sum()) + 1


def principal_projection(d: torch.Tensor, source: torch.Tensor, rank_fraction: float = 0.1) -> float:
    """p_k = ‖U_kᵀ ΔW V_k‖_F² / ‖ΔW‖_F², with U_k, V_k the source's top-k singular vectors and
    k = ⌈rank_fraction · min(out, in)⌉ (0 for a zero delta)."""
    total = float(d.float().double().square().sum())
    if total == 0:
        return 0.0
    u, _, vh = torch.linalg.svd(source.float().double(), full_matrices=False)
    k = max(1, math.ceil(rank_fraction * min(source.shape)))
    inner = u[:, :k].T @ d.float().double() @ vh[:k].T
    return float(inner.square().sum()) / total


def principal_mask(source: torch.Tensor, rank_fraction: float = 0.1, fraction: float = 0.1) -> torch.Tensor:
    """M_prin (module doc): the `fraction` of coordinates largest in |U_k Σ_k V_kᵀ|."""
    u, s, vh = torch.linalg.svd(source.float().double(), full_matrices=False)
    k = max(1, math.ceil(rank_fraction * min(source.shape)))
    approx = ((u[:, :k] * s[:k]) @ vh[:k]).abs().flatten()
    return _top_mask(approx, fraction).reshape(source.shape)


def low_magnitude_mask(source: torch.Tensor, fraction: float = 0.1) -> torch.Tensor:
    """M_low: the `fraction` (⌈fraction·n⌉) of coordinates with the smallest |W_src|."""
    flat = source.float().abs().flatten()
    return _top_mask(-flat, fraction).reshape(source.shape)


def _top_mask(score: torch.Tensor, fraction: float) -> torch.Tensor:
    mask = torch.zeros(score.numel(), dtype=torch.bool)
    k = min(score.numel(), math.ceil(fraction * score.numel()))
    if k:
        mask[score.topk(k).indices] = True
    return mask


def coverage(visible_mask: torch.Tensor, region: torch.Tensor) -> float:
    """The fraction of visibly updated coordinates that fall in `region` (0 if none is visible)."""
    n = int(visible_mask.sum())
    return int((visible_mask & region).sum()) / n if n else 0.0


def subnetwork_mask(trained: torch.Tensor, initial: torch.Tensor, tau: float) -> torch.Tensor:
    """m_i = 1{|θ_full,i − θ_0,i| > τ}: the coordinates a masked retraining would train."""
    return delta(trained, initial).abs() > tau


# ------------------------------------------------------------------- module types


_MODULE_TYPES: tuple[tuple[str, str], ...] = (
    (r"(experts|shared_expert)", "moe_expert"),
    (r"router|mlp\.gate\.weight$", "router"),
    (r"(norm|layer_norm_weight)", "norm"),
    (r"(word_embeddings|embed_tokens|ngram)", "embedding"),
    (r"(output_layer|lm_head)", "output"),
    (r"(linear_qkv\.weight|[qkv]_proj)", "attn_qkv"),
    (r"(linear_proj|o_proj)", "attn_out"),
    (r"(linear_fc1|gate_proj|up_proj)", "mlp_in"),
    (r"(linear_fc2|down_proj)", "mlp_out"),
)


def module_type(name: str) -> str:
    """The module a megatron or HF parameter name belongs to (attn_qkv, mlp_in, norm, …; 'other')."""
    for pattern, kind in _MODULE_TYPES:
        if re.search(pattern, name):
            return kind
    return "other"


# ------------------------------------------------------------------- checkpoints


def _is_hf_dir(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, by name, as stored (megatron's stacked layer tensors are
    split into `decoder.layers.<i>.…`, the global names of `mcore_rl.hf.weight_map`). Optimizer state
    and megatron's `_extra_state` objects are left out."""
    if _is_hf_dir(path):
        from mcore_rl.convert.hf_checkpoint import HFCheckpoint  # lazy: transformers

        ckpt = HFCheckpoint(path)
        return {name: ckpt[name] for name in ckpt}
    return _load_dist_checkpoint(path)


def dist_checkpoint_path(path: str) -> str:
    """The `iter_*` dir of a megatron save dir (its `latest`), or `path` if it is one."""

    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(
            f"{path}: neither a Hugging Face dir (model.safetensors) nor a megatron checkpoint "
            "(metadata.json, or a 'latest' file)"
        )
    return found


def _load_dist_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = dist_checkpoint_path(path)
    meta = FileSystemReader(path).read_metadata()
    stored = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.") and "_extra_state" not in k
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(stored, checkpoint_id=path, no_dist=True)  # the requested tensors only, in one process
    out: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.startswith("decoder.layers."):
            rest = name[len("decoder.layers.") :]
            for i, layer in enumerate(tensor.unbind(0)):
                out[f"decoder.layers.{i}.{rest}"] = layer
        else:
            out[name] = tensor
    return out


# ------------------------------------------------------------------- the analysis


def compare(
    source: dict[str, torch.Tensor],
    trained: dict[str, torch.Tensor],
    *,
    eps: float = 1e-5,
    top_p: float = 0.01,
    top_k: int = 16,
    tau: float = 1e-5,
    energy: float = 0.99,
    rank_fraction: float = 0.1,
    low_fraction: float = 0.1,
    spectral: bool = True,
) -> dict[str, Any]:
    """All quantities, overall and per module type (module doc). Names must match in both."""
    missing = sorted(set(source) ^ set(trained))
    if missing:
        raise ValueError(f"the checkpoints hold different tensors, e.g. {missing[:5]}")
    groups: dict[str, _Acc] = {}
    for name in sorted(source):
        d = delta(trained[name], source[name])
        g = groups.setdefault(module_type(name), _Acc())
        g.add(
            d,
            source[name],
            eps=eps,
            top_k=top_k,
            tau=tau,
            energy=energy,
            rank_fraction=rank_fraction,
            low_fraction=low_fraction,
            spectral=spectral,
        )
    total = _Acc()
    for g in groups.values():
        total.merge(g)
    return {
        "overall": total.result(top_p, eps),
        "by_module": [{"module": k, **v.result(top_p, eps)} for k, v in sorted(groups.items())],
    }


class _Acc(dict):
    """Pooled coordinate counts and per-matrix spectral numbers of one module type."""

    def __init__(self) -> None:
        super().__init__(n=0, visible=0, d2=0.0, s2=0.0, sq=[], prin=0, low=0, mats={})

    def add(
        self,
        d: torch.Tensor,
        src: torch.Tensor,
        *,
        eps: float,
        top_k: int,
        tau: float,
        energy: float,
        rank_fraction: float,
        low_fraction: float,
        spectral: bool,
    ) -> None:
        vis = visible(d, eps)
        self["n"] += d.numel()
        self["visible"] += int(vis.sum())
        self["d2"] += float(d.double().square().sum())
        self["s2"] += float(src.float().double().square().sum())
        self["sq"].append(d.float().flatten().square())
        for dm, sm, vm in zip(_as_matrices(d), _as_matrices(src), _as_matrices(vis)):
            vm = vm.bool()
            self["low"] += int((vm & low_magnitude_mask(sm, low_fraction)).sum())
            if not spectral:
                continue
            self["prin"] += int((vm & principal_mask(sm, rank_fraction, low_fraction)).sum())
            for key, value in (
                ("e_k", spectral_energy(dm, top_k)),
                ("stable_rank", stable_rank(dm)),
                ("rank_tau", numerical_rank(dm, tau)),
                ("effective_rank", effective_rank(dm, energy)),
                ("principal_projection", principal_projection(dm, sm, rank_fraction)),
            ):
                self["mats"].setdefault(key, []).append(float(value))

    def merge(self, other: _Acc) -> None:
        for key in ("n", "visible", "d2", "s2", "prin", "low"):
            self[key] += other[key]
        self["sq"] += other["sq"]
        for key, values in other["mats"].items():
            self["mats"].setdefault(key, []).extend(values)

    def result(self, top_p: float, eps: float) -> dict[str, Any]:
        n, vis = self["n"], self["visible"]
        out: dict[str, Any] = {
            "params": n,
            "relative_norm": math.sqrt(self["d2"] / self["s2"]) if self["s2"] > 0 else 0.0,
            "sparsity": 1.0 - vis / n if n else 1.0,
            f"top{top_p:g}_energy": top_energy(torch.cat(self["sq"]).sqrt(), top_p) if self["sq"] else 1.0,
            "low_coverage": self["low"] / vis if vis else 0.0,
        }
        if self["mats"]:
            out["principal_coverage"] = self["prin"] / vis if vis else 0.0
            out["matrices"] = len(self["mats"]["e_k"])
            for key, values in self["mats"].items():
                out[key] = sum(values) / len(values)
        return out


def write_mask(
    source: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], tau: float, path: str
) -> dict[str, Any]:
    """Save {name: subnetwork_mask} (megatron names only: what `optimizer.update_mask` reads)."""
    if any(name.startswith("model.") or name == "lm_head.weight" for name in source):
        raise ValueError(
            "--write-mask needs megatron checkpoints (optimizer.update_mask is keyed by megatron "
            "names); convert the HF dirs with `mcore-rl convert hf-to-mcore` first"
        )
    masks = {name: subnetwork_mask(trained[name], source[name], tau) for name in sorted(source)}
    torch.save(masks, path)
    n = sum(m.numel() for m in masks.values())
    return {"path": path, "tau": tau, "density": sum(int(m.sum()) for m in masks.values()) / n if n else 0.0}


@analysis(
    "update_sparsity",
    "sparsity, rank and location of the update between two checkpoints "
    "(OPD-Sparsity; SGD-vs-Adam-RLVR's sparsity and effective rank)",
)
def add_arguments(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("source", help="checkpoint before (megatron save dir / iter_* dir, or HF dir)")
    p.add_argument("trained", help="checkpoint after, in either format (names must match the source's)")
    p.add_argument("--eps", type=float, default=1e-5, help="visibility / ℓ0 threshold on |ΔW| (1e-5)")
    p.add_argument("--top-p", type=float, default=0.01, help="coordinate fraction for the top-p energy c_p")
    p.add_argument("--top-k", type=int, default=16, help="singular values for the spectral energy e_k")
    p.add_argument("--tau", type=float, default=1e-5, help="numerical rank: σ_i > τ·σ_1")
    p.add_argument("--energy", type=float, default=0.99, help="effective rank's energy share")
    p.add_argument("--rank-fraction", type=float, default=0.1, help="source principal subspace, share of min(m, n)")
    p.add_argument("--low-fraction", type=float, default=0.1, help="M_low (and M_prin) size, share of coordinates")
    p.add_argument("--no-svd", action="store_true", help="coordinate numbers only (SVDs are slow on big models)")
    p.add_argument(
        "--write-mask",
        default=None,
        help="also write the subnetwork mask |trained - source| > "
        "--mask-tau as a .pt for optimizer.update_mask (megatron checkpoints: megatron names)",
    )
    p.add_argument("--mask-tau", type=float, default=1e-5, help="the subnetwork mask's threshold τ")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        source, trained = load_weights(args.source), load_weights(args.trained)
        result = compare(
            source,
            trained,
            eps=args.eps,
            top_p=args.top_p,
            top_k=args.top_k,
            tau=args.tau,
            energy=args.energy,
            rank_fraction=args.rank_fraction,
            low_fraction=args.low_fraction,
            spectral=not args.no_svd,
        )
        out = {"source": args.source, "trained": args.trained, **result}
        if args.write_mask:
            out["mask"] = write_mask(source, trained, args.mask_tau, args.write_mask)
        return out

    return run
