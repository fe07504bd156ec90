"""Distributed checkpoints: an interrupted run resumes exactly; a checkpoint loads in other layouts."""

from __future__ import annotations

import os

import pytest

from tests.world import run_world

pytestmark = pytest.mark.slow


def _cfg(run_dir: str, iters: int, parallel: dict, **checkpoint):
    from mcore_rl.config import SFTConfig, load_config

    overrides = [
        f"run_dir={run_dir}", f"train.train_iters={iters}", "train.log_interval=100",
        "train.micro_batch_size=2", "train.global_batch_size=8", "train.seq_length=32",
        "data.synthetic_num_examples=512", "model.num_layers=4", "optimizer.lr=3e-3",
        "optimizer.lr_warmup_iters=2",
    ]
    overrides += [f"parallel.{k}={v}" for k, v in parallel.items()]
    overrides += [f"checkpoint.{k}={v}" for k, v in checkpoint.items()]
    return load_config(SFTConfig, None, overrides)


def _weights(trainer):
    from mcore_rl.models.shards import gather_full_state_dict

    return gather_full_state_dict(trainer.chunks)


def _resume_world(rank: int, world_size: int, tmp: str) -> None:
    import torch

    from mcore_rl.train import sft

    tp2 = {"tensor_model_parallel_size": 2, "sequence_parallel": "true"}
    # Uninterrupted: 6 steps.
    full = [r["loss"] for r in sft.run_sft(_cfg(f"{tmp}/a", 6, tp2))]
    # Interrupted after 3 steps (checkpoint), then resumed to 6 in the same layout.
    sft.run_sft(_cfg(f"{tmp}/b", 3, tp2, save_dir=f"{tmp}/ckpt"))
    assert os.path.exists(f"{tmp}/ckpt/latest")
    resumed = [r["loss"] for r in sft.run_sft(_cfg(f"{tmp}/c", 6, tp2, load_dir=f"{tmp}/ckpt"))]
    assert len(resumed) == 3
    assert resumed == full[3:], (resumed, full[3:])  # bit-identical: same layout, same RNG

    # The same checkpoint in other layouts: identical weights, the same next loss (fp32 noise only).
    reference = sft.build_trainer(_cfg(f"{tmp}/d", 6, tp2, load_dir=f"{tmp}/ckpt"))
    ref_weights, ref_step = _weights(reference), sft.train_step(reference)["loss"]
    assert ref_step == full[3]
    for layout in ({"pipeline_model_parallel_size": 2}, {}, {"pipeline_model_parallel_size": 2,
                   "virtual_pipeline_model_parallel_size": 2}):
        trainer = sft.build_trainer(_cfg(f"{tmp}/e", 6, layout, load_dir=f"{tmp}/ckpt"))
        weights = _weights(trainer)
        assert set(weights) == set(ref_weights)
        for key, value in ref_weights.items():
            assert torch.equal(weights[key], value), (layout, key)
        loss = sft.train_step(trainer)["loss"]
        assert abs(loss - ref_step) <= 1e-5 * abs(ref_step), (layout, loss, ref_step)
        # Optimizer moments, scheduler and data position came along: the second step agrees too.
        second = sft.train_step(trainer)["loss"]
        assert abs(second - full[4]) <= 1e-5 * abs(full[4]), (layout, second, full[4])


def test_resume_and_reshard(tmp_path):
    run_world(2, _resume_world, str(tmp_path))


def test_missing_checkpoint_names_the_path(tmp_path):
    from mcore_rl.train.checkpoint import latest_checkpoint

    with pytest.raises(FileNotFoundError, match="nowhere"):
        latest_checkpoint(str(tmp_path / "nowhere"))
    assert latest_checkpoint(str(tmp_path)) is None
