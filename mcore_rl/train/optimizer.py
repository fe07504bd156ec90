"""AdamW (or plain SGD) for megatron-core models that runs on CPU and GPU.

megatron-core's own optimizers allocate CUDA tensors in their constructors, so the project keeps
this small replacement. It does what the trainer needs from them and nothing more:

* fp32 master weights for bf16 models (the update is applied to the master, then copied back);
* the global gradient norm under TP/PP/EP, with megatron-core's counting rules, and clipping;
* a skipped step (and zeroed grads) when the norm is not finite;
* optionally an update mask (`optimizer.update_mask`): frozen coordinates stay bit-identical;
* two inner AdamW kernels: `torch.optim.AdamW(foreach=True)` or DeepSpeed's CPU Adam; or, with
  `optimizer.name: sgd`, plain SGD (`PlainSGD`: no momentum, no optimizer state; SGD-vs-Adam-RLVR),
  through the same masters, norm, clipping, skipping, checkpoint and snapshot code;
* plain and megatron-distributed (re-shardable) checkpoints, and an in-memory
  `snapshot()/restore()` that is bit-identical (for rolling back a rejected update).

Gradients are read from `param.main_grad` (left there by megatron-core's DistributedDataParallel
after `finish_grad_sync()`) or, without DDP, from `param.grad`. Zeroing `main_grad` is the DDP's job
(`model.zero_grad_buffer()`).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.config.schema import OptimizerConfig
from mcore_rl.train.lr_schedule import LRScheduler

logger = logging.getLogger(__name__)

_FP32_PARAM_PREFIX = "optimizer.state.fp32_param"
# parameter name -> its key in a megatron dist-checkpoint, where they differ (TransformerLayer's
# sharded_state_dict_keys_map for the local spec)
_CHECKPOINT_NORM_NAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
)


# --------------------------------------------------------------------------------------------
# Inner AdamW kernels
# --------------------------------------------------------------------------------------------


def load_deepspeed_cpu_adam() -> type:
    """Return `DeepSpeedCPUAdam` with its C++ op built (JIT, ~1 min the first time, then cached
    under ~/.cache/torch_extensions); raise a RuntimeError naming the config key otherwise."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as exc:  # ImportError, or deepspeed failing its own import-time checks
        raise RuntimeError(
            "optimizer.backend='deepspeed' needs the deepspeed package "
            "(pip install 'mcore-rl[cpu-adam]'); importing it failed: "
            f"{type(exc).__name__}: {exc}. Use optimizer.backend=torch instead."
        ) from exc
    try:
        CPUAdamBuilder().load()
    except Exception as exc:
        raise RuntimeError(
            "optimizer.backend='deepspeed': DeepSpeed's cpu_adam op failed to build/load "
            "(it JIT-compiles with ninja and a C++ compiler): "
            f"{type(exc).__name__}: {exc}. Use optimizer.backend=torch instead."
        ) from exc
    return DeepSpeedCPUAdam


class PlainSGD(torch.optim.Optimizer):
    """Vanilla SGD, θ ← θ − lr·g (SGD-vs-Adam-RLVR, arXiv:2602.07729): no momentum, no adaptive rate, and no
    per-parameter state at all (`state` stays empty, so checkpoints and snapshots carry none).

    Not `torch.optim.SGD`: its foreach kernel computes θ + (−lr)·g fused, which differs from θ − lr·g
    in the last bit; here the product is rounded first, so one step equals `p - lr * g` exactly.
    Weight decay is decoupled, as in AdamW (θ ← θ·(1 − lr·wd) before the step); without momentum
    that is the same update as L2 decay in the gradient."""

    def __init__(self, params: Any, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # takes no closure, so it returns None where torch's returns the closure's loss
        assert closure is None, "PlainSGD takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, wd = group["lr"], group["weight_decay"]
            if wd != 0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_sub_(params, torch._foreach_mul([p.grad for p in params], lr))


def _make_inner(
    groups: list[dict[str, Any]], cfg: OptimizerConfig, params: list[torch.Tensor]
) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        if cfg.backend != "torch":
            raise ValueError(f"optimizer.name='sgd' has only the torch kernel, not backend={cfg.backend!r}")
        return PlainSGD(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.name != "adamw":
        raise ValueError(f"unknown optimizer.name {cfg.name!r} (expected 'adamw' or 'sgd')")
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.backend == "torch":
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            foreach=True,
        )
    if cfg.backend == "deepspeed":
        off_cpu = [p for p in params if p.device.type != "cpu"]
        if off_cpu:
            raise ValueError(
                "optimizer.backend='deepspeed' (DeepSpeedCPUAdam) only updates CPU tensors, but "
                f"{len(off_cpu)} optimizer parameters are on {off_cpu[0].device}. "
                "Use optimizer.backend=torch on GPU."
            )
        cls = load_deepspeed_cpu_adam()
        return cls(
            groups,
            lr=cfg.lr,
            betas=betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            adamw_mode=True,
        )
    raise ValueError(f"unknown optimizer.backend {cfg.backend!r} (expected 'torch' or 'deepspeed')")


# --------------------------------------------------------------------------------------------
# Gradient norm under model parallelism
# --------------------------------------------------------------------------------------------


def _is_expert(param: torch.Tensor) -> bool:
    """megatron-core marks expert-parallel params with `allreduce=False` (no DP all-reduce)."""
    return not getattr(param, "allreduce", True)


def _parallel_state():
    """megatron's parallel_state if its groups exist, else None (single process / not set up).

    Checks torch.distributed first so single-process use never pays megatron's ~5 s import."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover - megatron-core is a hard dependency
        return None
    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def _counts_for_norm(param: torch.Tensor, ps: Any) -> bool:
    """megatron-core's `get_main_grads_for_grad_norm` rule: skip `shared` params (the last-stage
    copy of tied embeddings) and tensor-parallel duplicates (only TP rank 0 counts them).

    One deliberate refinement: expert params are de-duplicated over the *expert* TP group, not the
    dense one. They are equal when expert_tensor_parallel_size == tensor_model_parallel_size (the
    default); when they differ, megatron's rule would drop an unpartitioned expert param (a bias)
    on dense-TP ranks > 0 and the norm would differ across ranks."""
    if getattr(param, "shared", False):
        return False
    if ps is None:
        return True
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    tp_group = None
    if _is_expert(param):
        tp_group = ps.get_expert_tensor_parallel_group(check_initialized=False)
    if tp_group is None:
        tp_group = ps.get_tensor_model_parallel_group()
    return param_is_not_tensor_parallel_duplicate(param, tp_group)


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2.0)
    return torch.stack(norms).float().square().sum()


def global_grad_norm(params: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
    """L2 norm of the whole model's gradient, identical on every rank of a model-parallel group.

    Dense params' squared norms are summed over TP×PP (`get_model_parallel_group`), expert
    params' over expert-TP×EP×PP (`get_expert_tensor_model_pipeline_parallel_group`). Gradients
    are assumed already reduced over data parallel (what DDP's `finish_grad_sync()` does). Both
    all-reduces run on every rank, even one without expert params, so no rank waits for a
    collective that another skips. Params sharded over data parallel too (`data_parallel_sharded`:
    n-gram tables with shard_over_data_parallel) hold different rows on each DP rank: their squares
    are summed over DP first (all DP ranks of a stage have the same params, so all or none join)."""
    ps = _parallel_state()
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    dp_sharded: list[torch.Tensor] = []
    for p, g in zip(params, grads):
        if _counts_for_norm(p, ps):
            if getattr(p, "data_parallel_sharded", False):
                dp_sharded.append(g)
            else:
                (expert if _is_expert(p) else dense).append(g)
    device = grads[0].device if grads else _default_device()
    dense_sq = _sum_of_squares(dense, device)
    expert_sq = _sum_of_squares(expert, device)
    if dp_sharded:
        dp_sharded_sq = _sum_of_squares(dp_sharded, device)
        if ps is not None:
            torch.distributed.all_reduce(dp_sharded_sq, group=ps.get_data_parallel_group())
        dense_sq = dense_sq + dp_sharded_sq
    if ps is not None:
        torch.distributed.all_reduce(dense_sq, group=ps.get_model_parallel_group())
        expert_group = ps.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False)
        if expert_group is not None:
            torch.distributed.all_reduce(expert_sq, group=expert_group)
    total_sq = float((dense_sq + expert_sq).item())
    return math.sqrt(total_sq) if math.isfinite(total_sq) else total_sq


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------


@dataclass
class OptimizerSnapshot:
    """Deep copy of everything an update changes; see `ModelParallelAdamW.snapshot`."""

    model_params: list[torch.Tensor]
    master_params: list[torch.Tensor | None]
    state: list[dict[str, Any]]
    scheduler: dict[str, Any]


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


class ModelParallelAdamW:
    """AdamW (or, with `optimizer.name: sgd`, `PlainSGD`) over all trainable params of the model
    chunks, aware of megatron-core parallelism. Only the inner kernel differs between the two.

    Param order (used by state dicts): params with ndim >= 2 first (weight-decayed), then 1-D
    params (biases, norm weights), which get no weight decay; within each, chunk order then
    `named_parameters()` order. `model_params[i]` is updated through `main_params[i]`, which is the
    same tensor in fp32 and an fp32 master copy for bf16/fp16 params in bf16 mode.
    """

    def __init__(
        self,
        model_chunks: list[torch.nn.Module],
        cfg: OptimizerConfig,
        precision: str,
        scheduler: LRScheduler,
    ) -> None:
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"train.precision must be 'fp32' or 'bf16', got {precision!r}")
        self.cfg = cfg
        self.precision = precision
        self.scheduler = scheduler

        decay: list[torch.Tensor] = []
        no_decay: list[torch.Tensor] = []
        seen: set[int] = set()
        for chunk in model_chunks:
            for _, param in chunk.named_parameters():
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                (no_decay if param.ndim <= 1 else decay).append(param)
        self.model_params: list[torch.Tensor] = decay + no_decay
        if not self.model_params:
            raise ValueError("the model chunks have no trainable parameters")

        self.main_params: list[torch.Tensor] = []
        self._has_master: list[bool] = []
        for p in self.model_params:
            if p.dtype == torch.float32:
                self.main_params.append(p)
                self._has_master.append(False)
            elif precision == "bf16" and p.dtype in (torch.bfloat16, torch.float16):
                self.main_params.append(p.detach().clone().float())
                self._has_master.append(True)
            else:
                raise ValueError(
                    f"train.precision={precision!r} cannot optimize a {p.dtype} parameter of shape "
                    f"{tuple(p.shape)}; build the model in fp32 or set train.precision=bf16"
                )

        n_decay = len(decay)
        groups = [
            {"params": self.main_params[:n_decay], "weight_decay": cfg.weight_decay},
            {"params": self.main_params[n_decay:], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        self.optimizer = _make_inner(groups, cfg, self.main_params)
        self._set_lr(self.scheduler.get_lr())
        self._update_masks: dict[int, torch.Tensor] = {}  # see set_update_mask

    # ---------------------------------------------------------------- training step

    def get_lr(self) -> float:
        return self.scheduler.get_lr()

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _collect_grads(self) -> tuple[list[int], list[torch.Tensor], list[int]]:
        """Point each main param's `.grad` at its fp32 gradient. Returns the indices that have one,
        those grads, and the indices whose `.grad` was set here (to drop after the update).

        An fp32 `main_grad` is used in place (as megatron-core does), so clipping scales the DDP
        buffer; it is zeroed by `zero_grad_buffer()` before the next backward anyway."""
        idx: list[int] = []
        grads: list[torch.Tensor] = []
        borrowed: list[int] = []
        for i, (p, main) in enumerate(zip(self.model_params, self.main_params)):
            g: torch.Tensor | None = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is None:
                main.grad = None
                continue
            if g.dtype != torch.float32:
                g = g.float()
            if main.grad is not g:
                main.grad = g
                borrowed.append(i)
            idx.append(i)
            grads.append(g)
        return idx, grads, borrowed

    @torch.no_grad()
    def step(self) -> dict[str, Any]:
        """One update. Returns `grad_norm` (before clipping), the `lr` used, and `skipped`.

        The scheduler only advances on an update that happened (megatron-core does the same)."""
        lr = self.scheduler.get_lr()
        idx, grads, borrowed = self._collect_grads()
        for i, g in zip(idx, grads):
            if i in self._update_masks:
                g.mul_(self._update_masks[i])  # frozen coordinates: no gradient, in the norm or the moments
        grad_norm = global_grad_norm([self.model_params[i] for i in idx], grads)
        if not math.isfinite(grad_norm):
            logger.warning("non-finite grad norm (%s): skipping the optimizer step", grad_norm)
            self.zero_grad()
            return {"grad_norm": grad_norm, "lr": lr, "skipped": True}

        if self.cfg.clip_grad > 0 and grads:
            coeff = self.cfg.clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                torch._foreach_mul_(grads, coeff)

        self._set_lr(lr)
        frozen = {i: self.main_params[i].detach().clone() for i in idx if i in self._update_masks}
        self.optimizer.step()
        for i, before in frozen.items():  # weight decay moved them: put them back, bit for bit
            main = self.main_params[i]
            main.copy_(torch.where(self._update_masks[i], main, before))

        masters = [i for i in idx if self._has_master[i]]
        if masters:
            torch._foreach_copy_([self.model_params[i].data for i in masters], [self.main_params[i] for i in masters])
        # Drop the `.grad`s set above: a param whose `.grad` still aliased its DDP `main_grad`
        # would have the next backward accumulate into `main_grad` twice (autograd adds into the
        # existing `.grad`, then DDP's hook adds `.grad` to `main_grad`).
        for i in borrowed:
            self.main_params[i].grad = None
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr, "skipped": False}

    def zero_grad(self) -> None:
        """Drop `.grad` on model and master params (DDP's `main_grad` buffers are not touched)."""
        for p, main in zip(self.model_params, self.main_params):
            p.grad = None
            main.grad = None

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh fp32 masters from the model params, after the model's weights were set from
        outside (a model-only checkpoint load, a weight broadcast)."""
        for p, main, has in zip(self.model_params, self.main_params, self._has_master):
            if has:
                main.copy_(p.detach().float())

    # ---------------------------------------------------------------- masked (subnetwork) training

    def set_update_mask(self, masks: dict[int, torch.Tensor]) -> None:
        """Train only where `masks[i]` (a bool tensor shaped like `model_params[i]`) is True; params
        without an entry train everywhere. OPD-Sparsity's subnetwork retraining (arXiv:2606.13657): outside the
        mask the gradient is zeroed before the norm (clipping and the moments never see it), and after
        the update the coordinates are put back, since weight decay would move them: they stay
        bit-identical to their values before the first masked step, for any number of steps."""
        checked: dict[int, torch.Tensor] = {}
        for i, m in masks.items():
            p = self.model_params[i]
            if tuple(m.shape) != tuple(p.shape):
                raise ValueError(f"update mask {i} has shape {tuple(m.shape)}, its parameter {tuple(p.shape)}")
            checked[i] = m.to(device=self.main_params[i].device, dtype=torch.bool)
        self._update_masks = checked

    def load_update_mask(self, path: str, model_chunks: list[torch.nn.Module]) -> None:
        """`optimizer.update_mask`: a `.pt` file {global megatron name: full bool mask} (written by
        `mcore-rl diagnose update_sparsity --write-mask`), sliced to this rank's shards."""
        from mcore_rl.models.shards import iter_local_params, shard_for_rank  # lazy: transformers

        full = torch.load(path, map_location="cpu", weights_only=True)
        position = {id(p): i for i, p in enumerate(self.model_params)}
        masks: dict[int, torch.Tensor] = {}
        for _, name, param in iter_local_params(model_chunks):
            if id(param) not in position:
                continue
            mask = full.get(name)
            if mask is None:  # megatron's checkpoints name the local spec's norms as TE's fused ones
                for local, stored in _CHECKPOINT_NORM_NAMES:
                    if name.endswith(local):
                        mask = full.get(name[: -len(local)] + stored)
            if mask is None and name == "output_layer.weight":
                mask = full.get("embedding.word_embeddings.weight")  # tied embeddings under PP
            if mask is None:
                raise KeyError(f"optimizer.update_mask {path} has no mask for {name!r}")
            masks[position[id(param)]] = shard_for_rank(mask, param, name)
        self.set_update_mask(masks)

    # ---------------------------------------------------------------- in-memory rollback

    @torch.no_grad()
    def snapshot(self) -> OptimizerSnapshot:
        """Copy params, masters, optimizer state and scheduler position (memory: about one more
        copy of params + optimizer state). Grads are not part of it."""
        return OptimizerSnapshot(
            model_params=[p.detach().clone() for p in self.model_params],
            master_params=[m.detach().clone() if has else None for m, has in zip(self.main_params, self._has_master)],
            state=[_clone_state(self.optimizer.state.get(m, {})) for m in self.main_params],
            scheduler=copy.deepcopy(self.scheduler.state_dict()),
        )

    @torch.no_grad()
    def restore(self, snap: OptimizerSnapshot) -> None:
        """Put back exactly what `snapshot()` saw; the snapshot stays valid for another restore.

        Note for backend='deepspeed': its C++ op caches beta^step and, after the step counter moves
        backwards, recomputes it with pow() instead of a running product, so an update replayed
        after a restore can differ from the original in the last bits (the restored state itself is
        exact)."""
        for p, saved_p in zip(self.model_params, snap.model_params):
            p.copy_(saved_p)
        for m, saved_m in zip(self.main_params, snap.master_params):
            if saved_m is not None:
                m.copy_(saved_m)
        for m, saved_state in zip(self.main_params, snap.state):
            if saved_state:
                self.optimizer.state[m] = _clone_state(saved_state)
            else:
                self.optimizer.state.pop(m, None)
        self.scheduler.load_state_dict(snap.scheduler)
        self._set_lr(self.scheduler.get_lr())

    # ---------------------------------------------------------------- plain checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state (param ids = positions in `main_params`), fp32 masters by the same
        ids, scheduler. Tensors are live references, as in torch's `state_dict()`."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "fp32_params": {i: m for i, (m, has) in enumerate(zip(self.main_params, self._has_master)) if has},
            "scheduler": self.scheduler.state_dict(),
            "backend": self.cfg.backend,
            "precision": self.precision,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict()`. Loads across backends (torch <-> deepspeed). Hyperparameters
        (betas, eps, weight decay) follow the current config, not the checkpoint."""
        self._load_inner(state["optimizer"])
        self._load_masters(state.get("fp32_params"))
        self.scheduler.load_state_dict(state["scheduler"])
        self._set_lr(self.scheduler.get_lr())

    def _load_inner(self, saved: dict[str, Any]) -> None:
        current = self.optimizer.param_groups
        saved_groups = saved["param_groups"]
        if len(saved_groups) != len(current):
            raise ValueError(
                f"optimizer checkpoint has {len(saved_groups)} param groups, this model has {len(current)}"
            )
        groups = [
            {**{k: v for k, v in cur.items() if k != "params"}, "params": list(sg["params"])}
            for cur, sg in zip(current, saved_groups)
        ]
        # torch's load_state_dict keeps the given tensors (no copy): clone so that loading from a
        # live state dict (another optimizer, a snapshot) never aliases its state.
        state = {k: _clone_state(v) for k, v in saved["state"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self._normalize_steps()

    def _load_masters(self, fp32_params: dict[int, torch.Tensor] | None) -> None:
        if not any(self._has_master):
            return
        if not fp32_params:
            logger.warning("checkpoint has no fp32 master params: using the model params")
            self.reload_model_params()
            return
        for i, (m, has) in enumerate(zip(self.main_params, self._has_master)):
            if has:
                m.copy_(fp32_params[i])

    def _normalize_steps(self) -> None:
        """torch's AdamW keeps `step` as a float32 tensor, DeepSpeed's as an int."""
        for st in self.optimizer.state.values():
            if "step" not in st:
                continue
            n = int(st["step"].item() if isinstance(st["step"], torch.Tensor) else st["step"])
            st["step"] = n if self.cfg.backend == "deepspeed" else torch.tensor(float(n))

    def _init_state(self) -> None:
        """Create zero state for params that have none yet, so a sharded state dict has the same
        structure on every rank and before the first step (what megatron's `init_state_fn` does).
        SGD has no state to create."""
        if self.cfg.name == "sgd":
            return
        for m in self.main_params:
            st = self.optimizer.state[m]
            if len(st) == 0:
                st["step"] = 0 if self.cfg.backend == "deepspeed" else torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)

    # ---------------------------------------------------------------- distributed checkpoints

    def sharded_state_dict(self, model_sharded_state_dict: dict[str, Any], is_loading: bool = False) -> dict[str, Any]:
        """Optimizer state as megatron `ShardedTensor`s keyed like the model's params, so a
        checkpoint saved with one TP/PP/EP layout loads into another.

        `model_sharded_state_dict` must be the model's `sharded_state_dict()` (built from the live
        params, i.e. keep_vars semantics, which megatron-core modules do). Keys produced:
        `optimizer.state.exp_avg.<key>`, `optimizer.state.exp_avg_sq.<key>` and, for bf16 params,
        `optimizer.state.fp32_param.<key>` (the names megatron-core's own optimizers use; SGD
        saves no moments, only the masters); `step`
        is saved once as `common_step`; the scheduler position as a common object. Param groups
        are not saved (they come from the current config).

        Usage: save `{"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}` with
        `dist_checkpointing.save`; to load, build the same with `is_loading=True`, pass it to
        `dist_checkpointing.load` and give the result's "optimizer" to `load_sharded_state_dict`.
        """
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        del is_loading  # state is always materialized, see _init_state
        self._init_state()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.model_params)
        missing = [i for i in range(len(self.model_params)) if i not in id_map]
        if missing:
            shapes = [tuple(self.model_params[i].shape) for i in missing[:5]]
            raise ValueError(
                f"{len(missing)} optimizer params (shapes {shapes}...) are not in the model's "
                "sharded state dict; it must hold the live parameter tensors"
            )

        inner = self.optimizer.state_dict()
        steps = {
            int(st["step"].item() if isinstance(st["step"], torch.Tensor) else st["step"])
            for st in inner["state"].values()
        }
        if len(steps) > 1:
            logger.warning(
                "optimizer steps differ across params %s (some params had no grad on some "
                "steps); the checkpoint keeps the largest",
                sorted(steps),
            )
        optim_state_to_sharding_state(inner, id_map, exclude_keys=("step",))
        inner["state"]["common_step"] = max(steps) if steps else 0

        # `name` (a common object): which kernel's state this is, so a resume can refuse a mismatch
        out: dict[str, Any] = {"optimizer": inner, "scheduler": self.scheduler.state_dict(), "name": self.cfg.name}
        masters = {
            i: make_sharded_optimizer_tensor(id_map[i], m, prefix=_FP32_PARAM_PREFIX)
            for i, (m, has) in enumerate(zip(self.main_params, self._has_master))
            if has
        }
        if masters:
            out["fp32_params"] = masters
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """Take the "optimizer" part of `dist_checkpointing.load(...)`; see `sharded_state_dict`."""
        opt = dict(loaded["optimizer"])
        state = dict(opt["state"])
        step = int(state.pop("common_step", 0))
        for st in state.values():
            st["step"] = step
        self._load_inner({"state": state, "param_groups": opt["param_groups"]})
        self._load_masters(loaded.get("fp32_params"))
        self.scheduler.load_state_dict(loaded["scheduler"])
        self._set_lr(self.scheduler.get_lr())


def build_optimizer(
    model_chunks: list[torch.nn.Module],
    cfg: OptimizerConfig,
    precision: str,
    total_iters: int,
) -> ModelParallelAdamW:
    """AdamW or SGD (`cfg.name`) with its LR schedule over `total_iters` updates (usually
    `train.train_iters`)."""
    if cfg.name not in ("adamw", "sgd"):
        raise ValueError(f"unknown optimizer.name {cfg.name!r} (expected 'adamw' or 'sgd')")
    opt = ModelParallelAdamW(model_chunks, cfg, precision, LRScheduler(cfg, total_iters))
    if cfg.update_mask:
        opt.load_update_mask(cfg.update_mask, model_chunks)
    return opt
