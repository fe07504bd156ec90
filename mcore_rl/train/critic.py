"""The critic V_φ of an advantage that reads one (`gae`, `steppo`; `algos/critic.py`): the policy's
megatron-core decoder with a scalar value head in place of the output layer (`models/value_head.py`,
what reward models use), in the policy's layout, with its own AdamW (`algorithm.critic.lr`).

`Critic.values` reads V at every response position of a batch (the position whose label is the
response token: the state before it), on the same packed micro-batches π's log-probs use, identical
on every rank (each sample lives on one DP rank; the last pipeline stage's values are broadcast).
`Critic.train_part` is one optimizer step on a mini-batch: PPO's clipped value loss
(`critic.value_loss`) summed over the value positions and divided by their global count, as the
policy loss is over tokens. It starts from the policy's starting weights (after `init.checkpoint`
and the warm start) under a fresh head, or from `algorithm.critic.init_checkpoint`, and is saved
beside the policy's checkpoints in `<save_dir>/critic/iter_*` (loaded at the policy's step on resume).
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from typing import Any
from collections.abc import Iterator, Sequence

import torch

from mcore_rl.algos.critic import value_loss
from mcore_rl.config import config_to_dict
from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.data.samples import Sample
from mcore_rl.models.value_head import HEAD_PARAM
from mcore_rl.train import checkpoint
from mcore_rl.train.packing import build_microbatches
from mcore_rl.train.rl_step import _dp, _reduce_last_stage

CRITIC_DIR = "critic"  # under checkpoint.save_dir
CRITIC_KEYS = ("value_old", "value_returns", "value_mask")  # what a mini-batch's value loss reads, [N, T] each
HEAD_SEED_OFFSET = 7_919  # the head's own init seed: train.seed + this

Batch = dict[str, torch.Tensor]


def _forward_step(loss: Any, data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple:
    from mcore_rl.train.forward_backward import attention_mask_from_segments  # lazy: megatron

    batch = next(data_iterator)
    mask = attention_mask_from_segments(batch.get("segment_ids"))
    return model(batch["tokens"], batch["position_ids"], mask), partial(loss, batch)


def _at_positions(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The value head's [b, s, 1] output at the micro-batch's response positions, [n, T] float."""
    return out[..., 0].float().reshape(-1)[batch["seq_pos"]]


class Critic:
    """What one rank holds of the critic."""

    def __init__(self, cfg: RLConfig, chunks: list[torch.nn.Module], optimizer: Any, pad_id: int) -> None:
        self.cfg, self.chunks, self.optimizer, self.pad_id = cfg, chunks, optimizer, pad_id

    def _microbatches(
        self, samples: Sequence[Sample], order: Sequence[int], num_positions: int, per_seq: dict | None = None
    ) -> list[Batch]:
        t = self.cfg.train
        dp_rank, dp_size = _dp()
        mbs = build_microbatches(
            samples, order, t.seq_length, t.micro_batch_size, dp_rank, dp_size, self.pad_id, num_positions, per_seq
        )
        keep = ("tokens", "position_ids", "segment_ids", "seq_index", "seq_pos") + CRITIC_KEYS
        return [{k: v for k, v in mb.items() if k in keep} for mb in mbs]

    @torch.no_grad()
    def values(self, samples: Sequence[Sample], num_positions: int) -> torch.Tensor:
        """[N, T]: V of the state before each response token (at the position whose label it is),
        identical on every rank; past a response's end the values of padding, to be masked."""
        from mcore_rl.train.forward_backward import forward_backward  # lazy: megatron

        mbs = self._microbatches(samples, range(len(samples)), num_positions)
        store: list[torch.Tensor] = []

        def collect(batch: Batch, out: torch.Tensor) -> tuple:
            store.append(_at_positions(out, batch).detach().cpu())
            zero = out.sum() * 0.0
            return zero, torch.tensor(1, dtype=torch.int), {"lm_loss": torch.zeros(2, device=out.device)}

        for c in self.chunks:
            c.eval()
        forward_backward(self.chunks, mbs, forward_only=True, forward_step=partial(_forward_step, collect))
        full = torch.zeros(len(samples), num_positions)
        for mb, vals in zip(mbs, store):  # only the last stage stored values (none elsewhere)
            if mb["seq_index"].numel():
                full[mb["seq_index"]] = vals
        return _reduce_last_stage(full)  # sum over DP (one rank holds each sample), last stage to all

    def train_part(
        self, samples: Sequence[Sample], part: Sequence[int], per_seq: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """One optimizer step of the value loss on the samples of `part` (`per_seq`'s CRITIC_KEYS:
        the values the advantages used, the returns, where they count); {} when nothing counts."""
        from mcore_rl.train.forward_backward import forward_backward  # lazy: megatron

        c = self.cfg.algorithm.critic
        if float(per_seq["value_mask"][list(part)].sum()) == 0:
            return {}
        num_positions = per_seq["value_mask"].shape[1]
        mbs = self._microbatches(samples, part, num_positions, {k: per_seq[k] for k in CRITIC_KEYS})
        sums: list[torch.Tensor] = []

        def loss(batch: Batch, out: torch.Tensor) -> tuple:
            v = _at_positions(out, batch)
            total, count, m = value_loss(
                v, batch["value_old"], batch["value_returns"], batch["value_mask"], c.value_clip, c.loss_coef
            )
            sums.append(torch.stack([m["clipfrac"] * count, count]).double().cpu())
            report = {"lm_loss": torch.stack([total.detach(), count.float()])}
            return total, count.round().to(torch.int), report

        for chunk in self.chunks:
            chunk.train()
        result = forward_backward(self.chunks, mbs, forward_step=partial(_forward_step, loss))
        opt = self.optimizer.step()
        clip = _reduce_last_stage(torch.stack(sums).sum(0) if sums else torch.zeros(2, dtype=torch.float64))
        return {
            "critic/value_loss": result["loss"],
            "critic/value_clipfrac": float(clip[0] / clip[1].clamp_min(1)),
            "critic/grad_norm": float(opt["grad_norm"]),
            "critic/lr": float(opt["lr"]),
        }

    # ---------------------------------------------------------------- checkpoints

    def save(self, save_dir: str, step: int) -> str:
        """`<save_dir>/critic/iter_<step>` with its optimizer (collective)."""
        common = {"model": config_to_dict(self.cfg.model), "critic": config_to_dict(self.cfg.algorithm.critic)}
        return checkpoint.save_checkpoint(os.path.join(save_dir, CRITIC_DIR), step, self.chunks, self.optimizer, common)

    def resume(self, load_dir: str, step: int) -> str:
        """Load the critic saved at the policy's `step` beside `load_dir` (the save_dir, or one of its
        iter_* directories)."""
        root = load_dir
        if os.path.exists(os.path.join(root, "metadata.json")):
            root = os.path.dirname(os.path.normpath(root))
        path = checkpoint.checkpoint_dir(os.path.join(root, CRITIC_DIR), step)
        if not os.path.exists(os.path.join(path, "metadata.json")):
            raise FileNotFoundError(
                f"algorithm.advantage {self.cfg.algorithm.advantage!r} trains a critic, but {path} holds no "
                "critic checkpoint of the step to resume from"
            )
        checkpoint.load_checkpoint(path, self.chunks, self.optimizer)
        self.optimizer.reload_model_params()
        return path

    def load_value_model(self, path: str) -> None:
        """Start from a value model's checkpoint (`mcore-rl rm-train`'s, one head): weights only."""
        from megatron.core import dist_checkpointing

        found = checkpoint.latest_checkpoint(path) or path
        common = dist_checkpointing.load_common_state_dict(found)["common"]
        heads = common.get("reward_model", {}).get("num_heads") if "reward_model" in common else None
        if "critic" not in common and heads != 1:
            raise ValueError(
                f"algorithm.critic.init_checkpoint: {found} is not a value model with one head "
                "(a critic's, or `mcore-rl rm-train`'s with reward_model.num_heads 1)"
            )
        checkpoint.load_checkpoint(found, self.chunks, None)
        self.optimizer.reload_model_params()

    @torch.no_grad()
    def copy_policy(self, policy_chunks: list[torch.nn.Module]) -> None:
        """The policy's weights into the critic's decoder (the value head keeps its own)."""
        from mcore_rl.models.shards import unwrap_model  # lazy: transformers

        for dst, src in zip(self.chunks, policy_chunks):
            theirs = dict(unwrap_model(src).named_parameters())
            for name, p in unwrap_model(dst).named_parameters():
                if name == HEAD_PARAM:
                    continue
                p.copy_(theirs[name])
        self.optimizer.reload_model_params()


def build_critic(cfg: RLConfig, total_iters: int, pad_id: int) -> Critic:
    """The critic's chunks (the policy's architecture and layout, untied, a one-scalar value head on
    the last stage) in DDP, and its optimizer (the policy's settings at `algorithm.critic.lr`)."""
    from megatron.core.models.gpt import GPTModel  # lazy: megatron

    from mcore_rl.models.builder import build_model, transformer_config  # lazy: megatron
    from mcore_rl.models.value_head import install_value_head  # lazy: megatron
    from mcore_rl.train.forward_backward import prepare_config, wrap_ddp  # lazy: megatron
    from mcore_rl.train.optimizer import build_optimizer  # lazy: numpy

    t, c = cfg.train, cfg.algorithm.critic
    model = dataclasses.replace(cfg.model, tie_word_embeddings=False)
    config = transformer_config(model, cfg.parallel, t.precision, t.recompute)
    bare = build_model(model, cfg.parallel, config=config)
    for chunk in bare:
        assert isinstance(chunk, GPTModel)
        install_value_head(chunk, 1, t.seed + HEAD_SEED_OFFSET)
    chunks = wrap_ddp(list(bare), config)
    prepare_config(config, chunks)
    opt_cfg = dataclasses.replace(cfg.optimizer, lr=cfg.optimizer.lr if c.lr is None else c.lr, update_mask=None)
    opt_cfg.min_lr = min(opt_cfg.min_lr, opt_cfg.lr)
    return Critic(cfg, chunks, build_optimizer(chunks, opt_cfg, t.precision, total_iters), pad_id)
