"""`remath_rollback`: Re-Math's training-free repair of cross-domain interference ("A Local
Perturbation Theory for Cross-Domain Interference and Recovery in Multi-Domain RL", TJU & Baidu 2026).

After sequential multi-domain RL (Code → Math → QA → CW) the early domain (the *victim*, Math) is
damaged by the later one (the *interferer*, QA). The paper's theory puts the damage on a small
shared conflict subspace; its training-free fix rolls a few MLP neurons back to their values before
the interference. Neuron i of layer ℓ is scored

    S_i = A_i · M_i · C_i
    A_i = min(pct(act_victim_i), pct(act_interferer_i))   shared activation
    M_i = pct(‖δ_interferer,i‖)                             update magnitude, δ_{Q|M} = QA_o − Math_o
    C_i = −cos(δ_victim,i, δ_interferer,i)                   conflict

and the ⌈budget·N⌉ best neurons (N: all MLP neurons of the model) take the victim checkpoint's
values; everything else keeps the interfered checkpoint's.

Choices where the summary is unclear (docs/design.md#paper-methods):
* a neuron is an MLP intermediate unit: its row of gate_proj and of up_proj and its column of
  down_proj (megatron: rows i and F+i of linear_fc1, column i of linear_fc2); its update vector is
  those three slices, concatenated. Attention neurons (the paper's 32% budget) are not built.
* δ_victim, the victim's own update, is Math_o − (the checkpoint before the Math stage): `--before`.
* pct is the within-layer percentile (average rank of equal values, 0 for the layer's smallest,
  1 for its largest); the selection is global over layers, as the budget is ("2% of MLP neurons").
* a neuron's activation is its mean |act(gate)·up| over the domain's tokens, which is the input of
  down_proj: `mlp_activation_stats` collects it from any Hugging Face model; the tool reads it from
  `.pt` files ({layer index: tensor [F]}), one per domain.
* a zero update vector has cosine 0 (no conflict).

Dense MLPs only (no MoE experts). Output: a Hugging Face dir (the input's files with the new
weights; from megatron dist-checkpoints through the project's megatron→HF map, `mcore-rl convert
hf-to-mcore` takes it back).

`mcore-rl diagnose remath_activations MODEL --data domain.jsonl --output act.pt` writes the activation
files from a Hugging Face model. The refresh, the paper's other repair (a short early-stopped GRPO run
on the victim domain), is the trainer's `data.mixture.stages[-1].stop_patience` (recipes/remath.py).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

import torch

from mcore_rl.diagnose import Runner, analysis
from mcore_rl.diagnose.update_sparsity import _is_hf_dir, dist_checkpoint_path, load_weights
from mcore_rl.data.tokenizer import load_tokenizer

# ------------------------------------------------------------------- neurons of a checkpoint


@dataclass(frozen=True)
class Slice:
    """Rows (`axis` 0) or columns (`axis` 1) `offset … offset+F` of one weight: neuron i is index offset+i."""

    name: str
    axis: int
    offset: int


_HF_MLP = re.compile(r"^(.*?)layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_MCORE_MLP = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(linear_fc1|linear_fc2)\.weight$")


def mlp_neurons(weights: dict[str, torch.Tensor]) -> dict[int, tuple[int, list[Slice]]]:
    """Per layer: (F, the slices holding its F neurons) for the dense MLPs of HF or megatron names."""
    layers: dict[int, tuple[int, list[Slice]]] = {}
    for name, t in weights.items():
        m = _HF_MLP.match(name)
        if m and "experts" not in name and "shared_expert" not in name:
            layer, kind = int(m.group(2)), m.group(3)
            f = t.shape[1] if kind == "down_proj" else t.shape[0]
            _add(layers, layer, f, [Slice(name, 1 if kind == "down_proj" else 0, 0)], name)
            continue
        m = _MCORE_MLP.match(name)
        if m:
            layer, kind = int(m.group(1)), m.group(2)
            if kind == "linear_fc1":
                f = t.shape[0] // 2
                _add(layers, layer, f, [Slice(name, 0, 0), Slice(name, 0, f)], name)
            else:
                _add(layers, layer, t.shape[1], [Slice(name, 1, 0)], name)
    for layer, (_f, slices) in layers.items():
        if len(slices) != 3:
            raise ValueError(f"layer {layer}: found {len(slices)} of the 3 MLP slices (gate, up, down): {slices}")
    return dict(sorted(layers.items()))


def _add(layers: dict[int, tuple[int, list[Slice]]], layer: int, f: int, slices: list[Slice], name: str) -> None:
    old_f, old = layers.get(layer, (f, []))
    if old_f != f:
        raise ValueError(f"{name}: {f} MLP neurons, but layer {layer}'s other MLP weights have {old_f}")
    layers[layer] = (f, old + slices)


def neuron_vectors(weights: dict[str, torch.Tensor], slices: list[Slice], f: int) -> torch.Tensor:
    """[F, D] float32: row i concatenates neuron i's slices."""
    parts = []
    for s in slices:
        t = weights[s.name].float()
        part = t[s.offset : s.offset + f] if s.axis == 0 else t[:, s.offset : s.offset + f].T
        parts.append(part)
    return torch.cat(parts, dim=1)


# ------------------------------------------------------------------- scores


def percentile(x: torch.Tensor) -> torch.Tensor:
    """Within-vector percentile in [0, 1]: average 0-based rank / (n − 1); equal values share one."""
    x = x.double().flatten()
    n = x.numel()
    if n <= 1:
        return torch.ones(n, dtype=torch.float64)
    s = torch.sort(x).values
    less = torch.searchsorted(s, x, right=False).double()
    equal = torch.searchsorted(s, x, right=True).double() - less
    return (less + (equal - 1) / 2) / (n - 1)


def conflict(victim_update: torch.Tensor, interferer_update: torch.Tensor) -> torch.Tensor:
    """C_i = −cos(δ_victim,i, δ_interferer,i) per row; 0 where either row is zero."""
    a, b = victim_update.double(), interferer_update.double()
    na, nb = a.norm(dim=1), b.norm(dim=1)
    cos = (a * b).sum(1) / (na * nb).clamp_min(1e-300)
    return torch.where((na > 0) & (nb > 0), -cos, torch.zeros_like(cos))


def neuron_scores(
    act_victim: torch.Tensor, act_interferer: torch.Tensor, victim_update: torch.Tensor, interferer_update: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A, M, C and S = A·M·C (float64, [F]) of one layer's neurons (module doc)."""
    f = victim_update.shape[0]
    for what, t in (
        ("act_victim", act_victim),
        ("act_interferer", act_interferer),
        ("interferer_update", interferer_update),
    ):
        if t.shape[0] != f:
            raise ValueError(f"{what} has {t.shape[0]} neurons, the layer has {f}")
    a = torch.minimum(percentile(act_victim), percentile(act_interferer))
    m = percentile(interferer_update.double().norm(dim=1))
    c = conflict(victim_update, interferer_update)
    return {"A": a, "M": m, "C": c, "S": a * m * c}


def select(scores: dict[int, torch.Tensor], budget: float) -> dict[int, torch.Tensor]:
    """The ⌈budget·N⌉ highest scores over all layers (ties: lower layer, then lower index first);
    per layer the selected neuron indices, sorted."""
    if not 0 <= budget <= 1:
        raise ValueError(f"rollback budget must be in [0, 1], got {budget}")
    flat = [(float(s), layer, i) for layer, t in scores.items() for i, s in enumerate(t.tolist())]
    k = math.ceil(budget * len(flat) - 1e-9)
    flat.sort(key=lambda x: (-x[0], x[1], x[2]))
    chosen: dict[int, list[int]] = {layer: [] for layer in scores}
    for _, layer, i in flat[:k]:
        chosen[layer].append(i)
    return {layer: torch.tensor(sorted(ix), dtype=torch.long) for layer, ix in chosen.items()}


def rollback(
    victim: dict[str, torch.Tensor],
    interfered: dict[str, torch.Tensor],
    layers: dict[int, tuple[int, list[Slice]]],
    chosen: dict[int, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The interfered weights with the chosen neurons' slices copied from the victim checkpoint."""
    out = {k: v.clone() for k, v in interfered.items()}
    for layer, idx in chosen.items():
        if not len(idx):
            continue
        _, slices = layers[layer]
        for s in slices:
            rows = idx + s.offset
            if s.axis == 0:
                out[s.name][rows] = victim[s.name][rows].to(out[s.name].dtype)
            else:
                out[s.name][:, rows] = victim[s.name][:, rows].to(out[s.name].dtype)
    return out


def plan(
    before: dict[str, torch.Tensor],
    victim: dict[str, torch.Tensor],
    interfered: dict[str, torch.Tensor],
    act_victim: dict[int, torch.Tensor],
    act_interferer: dict[int, torch.Tensor],
    budget: float,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Score, select and roll back; returns the new weights and a summary."""
    for what, w in (("before", before), ("victim", victim)):
        if set(w) != set(interfered):
            raise ValueError(
                f"the {what} checkpoint holds other tensors than the interfered one, e.g. "
                f"{sorted(set(w) ^ set(interfered))[:5]}"
            )
    layers = mlp_neurons(interfered)
    if not layers:
        raise ValueError("no dense MLP weights found (gate/up/down_proj or linear_fc1/fc2)")
    scores: dict[int, dict[str, torch.Tensor]] = {}
    for layer, (f, slices) in layers.items():
        for what, acts in (("victim", act_victim), ("interferer", act_interferer)):
            if layer not in acts:
                raise KeyError(f"no {what}-domain activations for layer {layer} (have {sorted(acts)[:8]})")
        v0, v1, v2 = (neuron_vectors(w, slices, f) for w in (before, victim, interfered))
        scores[layer] = neuron_scores(act_victim[layer], act_interferer[layer], v1 - v0, v2 - v1)
    chosen = select({layer: s["S"] for layer, s in scores.items()}, budget)
    new = rollback(victim, interfered, layers, chosen)
    n = sum(f for f, _ in layers.values())
    summary = {
        "neurons": n,
        "budget": budget,
        "rolled_back": sum(len(ix) for ix in chosen.values()),
        "by_layer": [
            {
                "layer": layer,
                "neurons": layers[layer][0],
                "rolled_back": len(chosen[layer]),
                "conflicting": int((scores[layer]["C"] > 0).sum()),
                "mean_score": float(scores[layer]["S"].mean()),
                "max_score": float(scores[layer]["S"].max()),
            }
            for layer in layers
        ],
    }
    return new, summary


# ------------------------------------------------------------------- activation statistics


@torch.no_grad()
def mlp_activation_stats(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Mean |input of down_proj| per MLP neuron and layer, over the tokens of `batches` (each the
    keyword arguments of one forward: input_ids, attention_mask; masked tokens do not count)."""
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, float] = {}
    mask_box: list[torch.Tensor | None] = [None]
    hooks = []
    for name, module in model.named_modules():
        m = re.search(r"layers\.(\d+)\.mlp\.down_proj$", name)
        if not m or "experts" in name:
            continue
        layer = int(m.group(1))

        def hook(_mod: torch.nn.Module, args: tuple[Any, ...], layer: int = layer) -> None:
            h = args[0].detach().float().abs()
            mask = mask_box[0]
            w = torch.ones(h.shape[:-1]) if mask is None else mask.to(h.dtype).reshape(h.shape[:-1])
            sums[layer] = sums.get(layer, 0) + (h * w[..., None]).reshape(-1, h.shape[-1]).sum(0)
            counts[layer] = counts.get(layer, 0.0) + float(w.sum())

        hooks.append(module.register_forward_pre_hook(hook))
    if not hooks:
        raise ValueError("the model has no `layers.<i>.mlp.down_proj` modules")
    try:
        was_training = model.training
        model.eval()
        for batch in batches:
            mask_box[0] = batch.get("attention_mask")
            model(**batch)
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    return {layer: sums[layer] / max(counts[layer], 1.0) for layer in sorted(sums)}


def load_activations(path: str) -> dict[int, torch.Tensor]:
    """A `.pt` file of {layer index: tensor [F]} (as `mlp_activation_stats` returns)."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict {{layer: tensor [F]}}, got {type(data).__name__}")
    return {int(k): torch.as_tensor(v).float().flatten() for k, v in data.items()}


# ------------------------------------------------------------------- writing the result


def write_result(new: dict[str, torch.Tensor], interfered_path: str, output: str) -> str:
    """A Hugging Face dir: from an HF input, its files with the new weights; from a megatron
    dist-checkpoint, the project's export of the new weights (config and assets from its common state)."""
    from mcore_rl.convert.to_hf import save_safetensors  # lazy: transformers

    if os.path.exists(output) and os.listdir(output):
        raise ValueError(f"--output {output} exists and is not empty")
    os.makedirs(output, exist_ok=True)
    if _is_hf_dir(interfered_path):
        for entry in sorted(os.listdir(interfered_path)):  # config, tokenizer, remote code: all but the weights
            src = os.path.join(interfered_path, entry)
            if os.path.isfile(src) and not (entry.endswith(".safetensors") or entry == "model.safetensors.index.json"):
                shutil.copyfile(src, os.path.join(output, entry))
        save_safetensors({k: v.contiguous() for k, v in new.items()}, output)
        return output
    from megatron.core import dist_checkpointing  # only the common state: no world needed

    from mcore_rl.convert.hf_checkpoint import ASSETS_DIR  # lazy: transformers
    from mcore_rl.convert.to_hf import stored_model_config, write_hf_checkpoint  # lazy: transformers
    from mcore_rl.hf.weight_map import full_megatron_to_hf  # lazy: transformers

    path = dist_checkpoint_path(interfered_path)
    common = dist_checkpointing.load_common_state_dict(path)["common"]
    mc = stored_model_config(common, path)
    dtype = next(iter(new.values())).dtype
    assets = os.path.join(os.path.dirname(path), ASSETS_DIR)
    write_hf_checkpoint(
        full_megatron_to_hf(new, mc),
        mc,
        output,
        dtype,
        common.get("hf_config"),
        assets if os.path.isdir(assets) else None,
    )
    return output


@analysis(
    "remath_rollback",
    "Re-Math's training-free neuron rollback: score MLP neurons by shared activation "
    "x update magnitude x conflict and roll the top ones back to the pre-interference checkpoint",
)
def add_arguments(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("--before", required=True, help="checkpoint before the victim domain's stage (e.g. Code_o)")
    p.add_argument("--victim", required=True, help="checkpoint after the victim's stage, before interference (Math_o)")
    p.add_argument("--interfered", required=True, help="checkpoint after the interfering stage (QA_o)")
    p.add_argument("--act-victim", required=True, help=".pt {layer: [F]} mean |activation| on victim-domain data")
    p.add_argument("--act-interferer", required=True, help=".pt {layer: [F]} on interfering-domain data")
    p.add_argument("--budget", type=float, default=0.02, help="share of MLP neurons rolled back (paper: 0.02)")
    p.add_argument("--output", required=True, help="new Hugging Face dir (must not exist or be empty)")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        new, summary = plan(
            load_weights(args.before),
            load_weights(args.victim),
            load_weights(args.interfered),
            load_activations(args.act_victim),
            load_activations(args.act_interferer),
            args.budget,
        )
        return {"output": write_result(new, args.interfered, args.output), **summary}

    return run


def read_texts(path: str, keys: list[str], limit: int) -> list[str]:
    """Up to `limit` texts from a jsonl file: each line's `keys` joined by a space (missing keys skipped)."""
    from mcore_rl.data.files import strict_jsonl

    texts: list[str] = []
    for n, bad, row in strict_jsonl(path, "a text example"):
        parts = [str(row[k]) for k in keys if k in row]
        if not parts:
            bad.fail(n, f"none of the keys {keys}")
        texts.append(" ".join(parts))
        if len(texts) >= limit:
            break
    if not texts:
        raise ValueError(f"{path}: no examples")
    return texts


def text_batches(texts: list[str], tokenizer: Any, batch_size: int, max_length: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded `input_ids` / `attention_mask` batches of the project's `Tokenizer` protocol."""
    out = []
    for i in range(0, len(texts), batch_size):
        ids = [tokenizer.encode(t)[:max_length] for t in texts[i : i + batch_size]]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[row, : len(x)] = 1
        out.append({"input_ids": input_ids, "attention_mask": mask})
    return out


@analysis(
    "remath_activations",
    "per-neuron MLP activation statistics of a Hugging Face model on one domain's "
    "data (the .pt files remath_rollback reads)",
)
def add_activation_arguments(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("model", help="Hugging Face dir (e.g. `mcore-rl convert mcore-to-hf` of the victim checkpoint)")
    p.add_argument("--data", required=True, help="jsonl of the domain's examples")
    p.add_argument("--keys", default="prompt,response", help="jsonl fields joined into one text (comma-separated)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model dir's, else the bundled one)")
    p.add_argument("--max-examples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--output", required=True, help="the .pt file to write ({layer: mean |activation| [F]})")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        tok_dir = args.tokenizer
        if tok_dir is None and any(
            os.path.exists(os.path.join(args.model, f))
            for f in ("tokenizer.json", "tokenizer_config.json", "mcore_rl_tokenizer.json")
        ):
            tok_dir = args.model
        tokenizer = load_tokenizer(tok_dir)
        model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, dtype=torch.float32)
        texts = read_texts(args.data, [k for k in args.keys.split(",") if k], args.max_examples)
        batches = text_batches(texts, tokenizer, args.batch_size, args.max_length)
        stats = mlp_activation_stats(model, batches)
        torch.save(stats, args.output)
        tokens = int(sum(b["attention_mask"].sum() for b in batches))
        return {
            "output": args.output,
            "examples": len(texts),
            "tokens": tokens,
            "layers": len(stats),
            "neurons": sum(int(v.numel()) for v in stats.values()),
        }

    return run
