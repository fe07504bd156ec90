"""Reward-model training on megatron-core: the `mcore-rl rm-train` loop.

The policy's decoder in any layout `mcore-rl sft` accepts, with a value head in place of the output
layer (`models/value_head.py`), trained on preference pairs (Bradley–Terry with margins and ties)
or labelled responses (pointwise binary) with the pure losses of `algos/reward_model.py`, or as a
process reward model (`beta_prm`: BetaPRM's Beta head read at each step's delimiter, trained on
Monte-Carlo counts with `algos/beta_prm.py`; the loss is a sum over steps). A
micro-batch of P pairs is one forward of 2P rows (chosen rows, then rejected rows), scored at each
row's last token; the loss is a sum over pairs that megatron-core divides by the global number of
pairs (`calculate_per_token_loss`), so the gradient does not depend on the split into micro-batches
and data-parallel ranks. Held-out pair accuracy and loss are logged at `train.eval_interval`;
checkpoints and resume are SFT's, with the `reward_model` section in the common state (the export
reads `num_heads` from it). `init.checkpoint` starts the decoder from a policy's checkpoint (any
layout; its output layer is not read) with a fresh value head and optimizer.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast
from collections.abc import Iterator

import torch
import torch.distributed as dist

from mcore_rl.algos.beta_prm import beta_head, beta_prm_loss
from mcore_rl.algos.z_reward import risd_loss
from mcore_rl.algos.reward_model import (
    binary_correct,
    bradley_terry_loss,
    pair_correct,
    pointwise_binary_loss,
    rrm_keep,
)
from mcore_rl.config import config_to_dict, save_config
from mcore_rl.config.rm_schema import RMConfig
from mcore_rl.config.rm_validate import validate_rm_config
from mcore_rl.data.preferences import (
    LabelledResponse,
    PreferencePair,
    labelled_rows,
    pair_rows,
    read_preference_file,
    rrm_augment,
    sequence_ids,
    task_pairs,
)
from mcore_rl.data.process_rewards import ProcessExample, process_rows, read_process_file
from mcore_rl.data.sft import SFTBatches
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.hf.classifier import last_token_scores, load_classifier
from mcore_rl.observe import ttfs
from mcore_rl.observe.run import RunObserver
from mcore_rl.parallel.preemption import preempted, stop_requested
from mcore_rl.train import checkpoint
from mcore_rl.train.forward_backward import forward_backward
from mcore_rl.train.hf_provenance import carry_provenance, read_provenance
from mcore_rl.train.policy import build_policy
from mcore_rl.train.warm_start import load_initial_weights

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
HELD_OUT_SEED_OFFSET = 1_000_003  # synthetic held-out pairs: other problems than the training pairs'


@dataclass
class RMTrainer:
    """What one rank holds while training a reward model."""

    cfg: RMConfig
    chunks: list[torch.nn.Module]
    optimizer: Any
    batches: SFTBatches
    eval_rows: Batch | None
    tokenizer: Tokenizer
    iteration: int = 0
    hf_provenance: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


Examples = list[PreferencePair] | list[LabelledResponse] | list[ProcessExample]


def _rows(cfg: RMConfig, examples: Examples, tokenizer: Tokenizer) -> Batch:
    if cfg.reward_model.objective == "beta_prm":
        return process_rows(
            cast(list[ProcessExample], examples), cfg.train.seq_length, cfg.data.step_delimiter, tokenizer
        )
    if cfg.reward_model.objective == "bradley_terry":
        return pair_rows(cast(list[PreferencePair], examples), cfg.train.seq_length, tokenizer)
    return labelled_rows(cast(list[LabelledResponse], examples), cfg.train.seq_length, tokenizer)


def build_rows(cfg: RMConfig, tokenizer: Tokenizer, dp: int) -> tuple[Batch, Batch | None]:
    """Training rows and held-out rows (`train.eval_iters` micro-batches per DP rank; None without
    evaluation). A file's held-out rows are its last ones; the task's are pairs of other problems,
    with the artefact on the wrong answer."""
    t, d = cfg.train, cfg.data
    n_eval = t.eval_iters * t.micro_batch_size * dp if t.eval_interval > 0 else 0
    if d.path is None:
        train = task_pairs(d.synthetic_task, d.synthetic_num_examples, t.seed, d.synthetic_max_digits, d.artifact)
        if d.rrm:
            train = _rrm(cfg, train, tokenizer)
        held = task_pairs(
            d.synthetic_task,
            n_eval,
            t.seed + HELD_OUT_SEED_OFFSET,
            d.synthetic_max_digits,
            d.artifact,
            reverse_artifact=d.artifact != "none",
        )
        return _rows(cfg, train, tokenizer), (_rows(cfg, held, tokenizer) if n_eval else None)
    examples: Examples = (
        read_process_file(d)
        if cfg.reward_model.objective == "beta_prm"
        else read_preference_file(d, cfg.reward_model.objective, cfg.reward_model.num_heads)
    )
    n = len(examples)
    if n_eval >= n:
        raise ValueError(f"train.eval_iters={t.eval_iters} holds out {n_eval} examples; {d.path} has only {n}")
    held_out = examples[n - n_eval :]
    kept = examples[: n - n_eval]
    if d.rrm:
        kept = _rrm(cfg, cast(list[PreferencePair], kept), tokenizer)
    return _rows(cfg, kept, tokenizer), (_rows(cfg, held_out, tokenizer) if n_eval else None)


def _rrm(cfg: RMConfig, pairs: list[PreferencePair], tokenizer: Tokenizer) -> list[PreferencePair]:
    """RRM's augmentation of the training pairs, filtered by `data.rrm_base_model` when set."""
    d = cfg.data
    augmented = rrm_augment(pairs, cfg.train.seed)
    new = augmented[len(pairs) :]
    if d.rrm_base_model is None:
        _log0(f"RRM: {len(new)} augmented pairs added to {len(pairs)} (unfiltered)")
        return augmented
    kept = rrm_filter(new, d.rrm_base_model, d.rrm_threshold, cfg.train.seq_length, tokenizer)
    _log0(
        f"RRM: {len(kept)} of {len(new)} augmented pairs kept (the base model {d.rrm_base_model} errs on them "
        f"by >= {d.rrm_threshold}), added to {len(pairs)}"
    )
    return list(pairs) + kept


RRM_BATCH = 64  # rows per forward of RRM's base model


def rrm_filter(
    pairs: list[PreferencePair], base_model_dir: str, threshold: float, seq_length: int, tokenizer: Tokenizer
) -> list[PreferencePair]:
    """The augmented pairs a base reward model gets wrong by >= `threshold` ("RRM: Robust Reward
    Model Training Mitigates Reward Hacking", arXiv:2409.13156; `algos/reward_model.py: rrm_keep`):
    the exported HF classifier scores each pair's two sequences (`[bos] prompt response [eos]`, cut at
    `seq_length` as training cuts them) on its head `pair.head`. Every rank scores them on the CPU,
    deterministically, so every rank keeps the same pairs."""
    if not pairs:
        return []
    model = load_classifier(base_model_dir, "cpu")
    labels = int(model.config.num_labels)
    heads = torch.tensor([p.head for p in pairs])
    if int(heads.max()) >= labels:
        raise ValueError(
            f"data.rrm_base_model: {base_model_dir} has {labels} heads; a pair trains head {int(heads.max())}"
        )
    pad = int(model.config.pad_token_id)
    scores = []
    for side in ("chosen", "rejected"):
        rows = [sequence_ids(p.prompt, getattr(p, side), tokenizer)[:seq_length] for p in pairs]
        out = [last_token_scores(model, rows[i : i + RRM_BATCH], pad) for i in range(0, len(rows), RRM_BATCH)]
        scores.append(torch.cat(out).gather(1, heads[:, None])[:, 0])
    target = torch.tensor([0.5 if p.tie else 1.0 for p in pairs])
    keep = rrm_keep(scores[0], scores[1], target, threshold)
    return [p for p, k in zip(pairs, keep.tolist()) if k]


def model_batch(mb: Batch) -> Batch:
    """A micro-batch of rows as the model reads it: pairs become their chosen rows then their
    rejected rows (`tokens` [2P, s], `index` [2P]); labelled responses pass through."""
    if "chosen_tokens" not in mb:
        out = dict(mb)
    else:
        out = {
            "tokens": torch.cat([mb["chosen_tokens"], mb["rejected_tokens"]]),
            "index": torch.cat([mb["chosen_index"], mb["rejected_index"]]),
            "margin": mb["margin"],
            "tie": mb["tie"],
            "head": mb["head"],
        }
    b, s = out["tokens"].shape
    out["position_ids"] = torch.arange(s).expand(b, s).contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------------


def sequence_scores(values: torch.Tensor, index: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """values [b, s, H] -> the score of each row's last token under its head [b]."""
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, index, head]


def step_values(values: torch.Tensor, step_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [b, s, H], step_index [b, T] (−1: no step) -> (the heads at each step [b, T, H], valid [b, T])."""
    valid = step_index >= 0
    at = step_index.clamp(min=0).unsqueeze(-1).expand(-1, -1, values.shape[-1])
    return torch.gather(values, 1, at), valid


def _loss(batch: Batch, stats: list[torch.Tensor], values: torch.Tensor, regularizer_weight: float = 1.0) -> tuple:
    """Summed loss over the micro-batch's pairs (responses, steps); megatron-core divides by the global count."""
    if "target" in batch:  # Z-Reward's student: KL to the teacher's score distribution
        logits = values[torch.arange(values.shape[0], device=values.device), batch["index"]]
        losses = risd_loss(batch["target"], logits)
        correct = (logits.detach().argmax(-1) == batch["target"].argmax(-1)).float()  # the teacher's mode
    elif "step_index" in batch:
        raw, valid = step_values(values, batch["step_index"])
        k, n = batch["successes"][valid], batch["rollouts"][valid]
        losses = beta_prm_loss(raw[valid], k, n, regularizer_weight)
        # a step counts as right when μ falls on the side of ½ that K/N is on (NaN at K/N = ½)
        correct = binary_correct(beta_head(raw[valid].detach())[0] - 0.5, k.float() / n.float())
    elif "margin" in batch:
        p = batch["margin"].shape[0]
        scores = sequence_scores(values, batch["index"], torch.cat([batch["head"], batch["head"]]))
        losses = bradley_terry_loss(scores[:p], scores[p:], batch["margin"], batch["tie"])
        correct = pair_correct(scores[:p].detach(), scores[p:].detach(), batch["tie"])
    else:
        scores = sequence_scores(values, batch["index"], batch["head"])
        losses = pointwise_binary_loss(scores, batch["label"])
        correct = binary_correct(scores.detach(), batch["label"])
    counted = ~torch.isnan(correct)
    stats.append(torch.stack([correct[counted].sum(), counted.sum()]).double().cpu())
    loss_sum = losses.sum()
    count = torch.tensor(losses.numel(), device=losses.device)
    return loss_sum, count.to(torch.int), {"lm_loss": torch.stack([loss_sum.detach(), count.float()])}


def _forward_step(
    stats: list[torch.Tensor], regularizer_weight: float, data_iterator: Iterator[Batch], model: torch.nn.Module
) -> tuple:
    batch = next(data_iterator)
    values = model(batch["tokens"], batch["position_ids"], None)
    return values, partial(_loss, batch, stats, regularizer_weight=regularizer_weight)


def _accuracy(stats: list[torch.Tensor]) -> float:
    """Held-out accuracy over the global batch: the last pipeline stage's counts, summed over DP."""
    from megatron.core import parallel_state as ps

    totals = torch.stack(stats).sum(0) if stats else torch.zeros(2, dtype=torch.float64)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            totals,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
    return float(totals[0]) / max(float(totals[1]), 1.0)


def rm_forward_backward(
    chunks: list[torch.nn.Module],
    microbatches: list[Batch],
    forward_only: bool = False,
    regularizer_weight: float = 1.0,
) -> dict:
    """Loss (mean over the global batch's pairs, responses or steps), their number and the accuracy."""
    stats: list[torch.Tensor] = []
    result = forward_backward(
        chunks,
        [model_batch(mb) for mb in microbatches],
        forward_only=forward_only,
        forward_step=partial(_forward_step, stats, regularizer_weight),
    )
    return {"loss": result["loss"], "count": result["num_tokens"], "accuracy": _accuracy(stats)}


@torch.no_grad()
def score_rows(chunks: list[torch.nn.Module], rows: Batch, micro_batch_size: int) -> torch.Tensor:
    """Each row's score under its head [n] (`tokens`, `index`, `head` rows, as `labelled_rows` makes),
    on every rank: a base model's view of data (RRM's filter). Forward only, every row on every
    data-parallel rank."""
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        chunk.eval()
    scores: list[torch.Tensor] = []

    def capture(batch: Batch, values: torch.Tensor) -> tuple:
        scores.append(sequence_scores(values, batch["index"], batch["head"]).float().cpu())
        zero = values.sum() * 0
        return zero, torch.tensor(1, dtype=torch.int), {"lm_loss": torch.zeros(2)}

    def step(data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple:
        batch = next(data_iterator)
        return model(batch["tokens"], batch["position_ids"], None), partial(capture, batch)

    n = rows["tokens"].shape[0]
    microbatches = [
        model_batch({k: v[i : i + micro_batch_size] for k, v in rows.items()}) for i in range(0, n, micro_batch_size)
    ]
    if microbatches[-1]["tokens"].shape[0] != micro_batch_size:  # the schedule wants equal micro-batches
        pad = micro_batch_size - microbatches[-1]["tokens"].shape[0]
        microbatches[-1] = {k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]) for k, v in microbatches[-1].items()}
    forward_backward(chunks, microbatches, forward_only=True, forward_step=step)
    out = torch.cat(scores)[:n] if scores else torch.zeros(n)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            out, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
    return out


def train_step(trainer: RMTrainer) -> dict[str, float]:
    for chunk in trainer.chunks:
        chunk.train()
    weight = trainer.cfg.reward_model.regularizer_weight
    result = rm_forward_backward(trainer.chunks, next(trainer.batches), regularizer_weight=weight)
    stats = trainer.optimizer.step()
    trainer.iteration += 1
    return {**result, **stats}


@torch.no_grad()
def evaluate(trainer: RMTrainer) -> dict[str, float]:
    """Loss and accuracy on the held-out rows."""
    from megatron.core import parallel_state as ps

    rows, mbs = trainer.eval_rows, trainer.cfg.train.micro_batch_size
    assert rows is not None
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = next(iter(rows.values())).shape[0] // dp
    mine = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in rows.items()}
    microbatches = [{k: v[i : i + mbs] for k, v in mine.items()} for i in range(0, per_rank, mbs)]
    for chunk in trainer.chunks:
        chunk.eval()
    weight = trainer.cfg.reward_model.regularizer_weight
    result = rm_forward_backward(trainer.chunks, microbatches, forward_only=True, regularizer_weight=weight)
    return {"eval_loss": result["loss"], "eval_accuracy": result["accuracy"]}


# ---------------------------------------------------------------------------------------------
# building, saving, the loop
# ---------------------------------------------------------------------------------------------


def value_head_installer(cfg: RMConfig) -> Any:
    """The `build_policy` adaptation that gives the last stage's chunks the value head."""
    from megatron.core.models.gpt import GPTModel  # lazy: megatron, imported by build_policy first

    from mcore_rl.models.value_head import install_value_head  # lazy: megatron

    def install(chunks: list[torch.nn.Module]) -> None:
        for chunk in chunks:
            assert isinstance(chunk, GPTModel)
            install_value_head(chunk, cfg.reward_model.num_heads, cfg.train.seed)

    return install


def build_trainer(cfg: RMConfig) -> RMTrainer:
    """Parallel state, model with its value head, optimizer, rows; resume if configured."""
    from megatron.core import parallel_state as ps

    policy = build_policy(cfg, validate_rm_config, cfg.train.train_iters, adapt=value_head_installer(cfg))
    dp = policy.sizes.data_parallel_size
    train_rows, eval_rows = build_rows(cfg, policy.tokenizer, dp)
    batches = SFTBatches(
        train_rows,
        cfg.train.micro_batch_size,
        policy.sizes.num_microbatches,
        ps.get_data_parallel_rank(),
        dp,
        cfg.train.seed,
    )
    trainer = RMTrainer(cfg, policy.chunks, policy.optimizer, batches, eval_rows, policy.tokenizer)
    ttfs.mark("data")
    path = _resume_path(cfg)
    if path is not None:
        _check_reward_model_checkpoint(path, cfg)
        common = checkpoint.load_checkpoint(path, trainer.chunks, trainer.optimizer)
        trainer.hf_provenance = read_provenance(common, path)
        trainer.optimizer.reload_model_params()
        if common.get("data_seed") == cfg.train.seed:
            batches.load_state_dict(common["data"])
        trainer.iteration = int(common["iteration"])
        ttfs.mark("checkpoint_load")
        _log0(f"resumed from {path} at iteration {trainer.iteration}")
        if cfg.init.checkpoint:
            _log0(f"init.checkpoint {cfg.init.checkpoint} not read: checkpoint.load_dir holds a checkpoint to resume")
    elif cfg.init.checkpoint:
        from mcore_rl.models.value_head import HEAD_PARAM  # lazy: megatron

        # the policy's decoder; its output layer (or none, tied) is not read: the value head stays as seeded
        head = HEAD_PARAM.rsplit(".", 1)[0]
        trainer.hf_provenance = load_initial_weights(cfg.init.checkpoint, trainer.chunks, _log0, skip=(head,))
        trainer.optimizer.reload_model_params()  # the optimizer's copy of the weights; its state starts empty
        ttfs.mark("checkpoint_load")
    return trainer


def _resume_path(cfg: RMConfig) -> str | None:
    """The checkpoint under `checkpoint.load_dir` to resume. With `init.checkpoint` set, a load_dir that
    does not exist yet or holds no checkpoint means a first start (a launcher that always passes its save
    dir); without it, that is an error."""
    load_dir = cfg.checkpoint.load_dir
    if not load_dir:
        return None
    if cfg.init.checkpoint and not os.path.isdir(load_dir):
        return None
    path = checkpoint.latest_checkpoint(load_dir)
    if path is None and not cfg.init.checkpoint:
        raise FileNotFoundError(f"checkpoint.load_dir {load_dir!r} holds no checkpoint")
    return path


def _check_reward_model_checkpoint(path: str, cfg: RMConfig) -> None:
    """A causal LM's checkpoint has the vocabulary's output layer where the value head goes: refused
    (`init.checkpoint` starts from one), as is one with another number of heads."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)["common"]
    stored = common.get("reward_model")
    if stored is None:
        raise ValueError(
            f"checkpoint.load_dir: {path} is a language model's checkpoint, not a reward model's; start from "
            "its decoder with init.checkpoint (a fresh value head) instead"
        )
    if int(stored.get("num_heads", 1)) != cfg.reward_model.num_heads:
        raise ValueError(
            f"checkpoint.load_dir: {path} has {stored.get('num_heads')} value head(s), "
            f"reward_model.num_heads is {cfg.reward_model.num_heads}"
        )


def save(trainer: RMTrainer) -> str:
    cfg = trainer.cfg
    common = {
        "data": trainer.batches.state_dict(),
        "data_seed": cfg.train.seed,
        "model": config_to_dict(cfg.model),
        "reward_model": config_to_dict(cfg.reward_model),  # the export's num_heads
        "special_tokens": {  # the export's config: HF's classifier pools at the last token that is not padding
            "pad_token_id": trainer.tokenizer.pad_id,
            "bos_token_id": trainer.tokenizer.bos_id,
            "eos_token_id": trainer.tokenizer.eos_id,
        },
    }
    save_dir = cfg.checkpoint.save_dir
    if save_dir is None:
        raise ValueError("checkpoint.save_dir: not set, so there is nowhere to save")
    common = carry_provenance(trainer.hf_provenance, common, save_dir)
    return checkpoint.save_checkpoint(save_dir, trainer.iteration, trainer.chunks, trainer.optimizer, common)


def run_rm(cfg: RMConfig) -> list[dict[str, Any]]:
    """Train as configured; returns the logged records (every rank). Metrics go to the sinks of
    `logging` (metrics.jsonl always): loss, pair accuracy of the batch, held-out loss and accuracy."""
    ttfs.begin_run()
    trainer = build_trainer(cfg)
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
    observer = RunObserver(cfg, rank0, dist.get_world_size(), cfg.train.seq_length, _log0)
    try:
        return _train(trainer, observer)
    finally:
        observer.close()


def _train(trainer: RMTrainer, observer: RunObserver) -> list[dict[str, Any]]:
    cfg, t = trainer.cfg, trainer.cfg.train
    if cfg.checkpoint.load_dir:
        observer.writer.resume(trainer.iteration)
    records: list[dict[str, Any]] = []
    timer = observer.timer
    # rows per step: two per pair; each row is train.seq_length tokens
    rows_per_example = 2 if cfg.reward_model.objective == "bradley_terry" else 1
    batch_tokens = t.global_batch_size * rows_per_example * t.seq_length
    window_tokens, window_start = 0.0, time.perf_counter()
    while trainer.iteration < t.train_iters:
        with observer.profile(trainer.iteration + 1, trainer.iteration + 1), timer.phase("train"):
            step = train_step(trainer)
        window_tokens += batch_tokens
        record: dict[str, Any] = {
            "step": trainer.iteration,
            "loss": step["loss"],
            "accuracy": step["accuracy"],
            "lr": step["lr"],
            "grad_norm": step["grad_norm"],
            "skipped": step["skipped"],
        }
        record.update(observer.perf(batch_tokens, timer.seconds["train"]))
        record.update(observer.first_step_done())
        if trainer.eval_rows is not None and (
            trainer.iteration % t.eval_interval == 0 or trainer.iteration == t.train_iters
        ):
            with timer.phase("eval"):
                record.update(evaluate(trainer))
        if trainer.iteration % t.log_interval == 0 or trainer.iteration == t.train_iters or "eval_loss" in record:
            elapsed = time.perf_counter() - window_start
            record["tokens_per_s"] = window_tokens / max(elapsed, 1e-9)
            window_tokens, window_start = 0.0, time.perf_counter()
            _log0(_format(record, t.train_iters))
        record.update(timer.take())
        records.append(record)
        observer.writer.write(record)
        interval = cfg.checkpoint.save_interval
        stop = stop_requested() if trainer.iteration < t.train_iters else None  # launch: pre-emption (collective)
        if cfg.checkpoint.save_dir and ((interval > 0 and trainer.iteration % interval == 0) or stop):
            with timer.phase("checkpoint"):
                _log0(f"saved {save(trainer)}")
        if stop:
            saved = (
                checkpoint.checkpoint_dir(cfg.checkpoint.save_dir, trainer.iteration)
                if cfg.checkpoint.save_dir
                else None
            )
            raise preempted(cfg.run_dir, trainer.iteration, stop, saved)
    if cfg.checkpoint.save_dir and (
        cfg.checkpoint.save_interval <= 0 or trainer.iteration % cfg.checkpoint.save_interval
    ):
        _log0(f"saved {save(trainer)}")
    return records


def _format(r: dict[str, Any], total: int) -> str:
    parts = [f"step {r['step']:>5}/{total}", f"loss {r['loss']:.4f}", f"acc {r['accuracy']:.1%}"]
    if "eval_loss" in r:
        parts += [f"eval_loss {r['eval_loss']:.4f}", f"eval_acc {r['eval_accuracy']:.1%}"]
    parts += [f"lr {r['lr']:.2e}", f"grad_norm {r['grad_norm']:.3f}"]
    if "tokens_per_s" in r:
        parts.append(f"{r['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def _log0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
