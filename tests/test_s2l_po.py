"""S2L-PO (`mcore_rl.algos.s2l_po`, `rollout.explorer`): a frozen smaller model supplies a decaying
share of each GRPO group through a second engine pool.

- the paper's testable properties (arXiv:2605.30789): α(1) = 1 ⇒ G_w = G, α(T_mix) = 0 ⇒ G_w = 0 and
  after, G_w + G_s = G, α non-increasing; G = 8, T_mix = 5 gives [8, 6, 4, 2, 0]; T_mix = 1 is pure
  GRPO; the merged group's advantage is plain GRPO (zero mean across both sources);
- what the mismatch correction sees for the explorer's samples (their own μ, or π_old);
- the `rollout.explorer` config keys and their errors (async runtime, R3, both sources, ...);
- in a trainer world: a real `mcore-rl serve` process the trainer starts on a smaller HF checkpoint
  written here; per-group composition at each step, the explorer's μ equal to the small model's
  log-probs, the learner's weights and advantages on a mixed batch, and a short `run_rl` whose
  metrics carry the explorer's share and rewards.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.mismatch import tis_weights
from mcore_rl.algos.multi_reward import OptionError
from mcore_rl.algos.s2l_po import behaviour_logp, explorer_share, s2l_po_explorer_count
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.config.schema import ModelConfig
from mcore_rl.recipes.config.s2l_po import ExplorerConfig

# ------------------------------------------------------------------------------- the schedule


def test_schedule_endpoints_sum_and_monotone() -> None:
    """Property 1: α(1) = 1 ⇒ G_w = G; α(T_mix) = 0 ⇒ G_w = 0; G_w = 0 after T_mix; G_w + G_s = G; α
    non-increasing (the trainer's 0-based step is the paper's i - 1)."""
    for t_mix in (2, 3, 5, 8, 13):
        for g in (1, 2, 5, 8, 16):
            counts = [s2l_po_explorer_count(i, g, mix_steps=t_mix) for i in range(t_mix + 5)]
            alphas = [explorer_share(i, mix_steps=t_mix) for i in range(t_mix + 5)]
            assert alphas[0] == 1.0 and counts[0] == g
            assert alphas[t_mix - 1] == 0.0 and counts[t_mix - 1] == 0
            assert all(c == 0 for c in counts[t_mix - 1 :]) and all(a == 0 for a in alphas[t_mix - 1 :])
            assert all(0 <= c <= g and c + (g - c) == g for c in counts)
            assert all(a >= b for a, b in zip(alphas, alphas[1:])) and all(a >= b for a, b in zip(counts, counts[1:]))


def test_schedule_g8_tmix5_and_the_papers_ceil() -> None:
    """Property 2: G = 8, T_mix = 5 gives [8, 6, 4, 2, 0] (0.75 · 8 is 6.000000000000001 in floats:
    not 7); the paper's ⌈αG⌉, not a round: T_mix = 8 at step 5 has α = 3/7, 8α = 3.43 -> 4."""
    assert [s2l_po_explorer_count(i, 8, mix_steps=5) for i in range(5)] == [8, 6, 4, 2, 0]
    assert [explorer_share(i, mix_steps=5) for i in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert s2l_po_explorer_count(4, 8, mix_steps=8) == 4 == math.ceil(8 * 3 / 7)
    assert s2l_po_explorer_count(1, 8, mix_steps=8) == 7  # 8 · 6/7 = 6.86
    # α_0 < 1 scales the whole ramp
    assert [s2l_po_explorer_count(i, 8, mix_steps=3, share=0.5) for i in range(4)] == [4, 2, 0, 0]


def test_tmix_one_or_zero_is_pure_grpo() -> None:
    """Property 3: T_mix = 1 would divide by zero: no explorer sample at any step (also T_mix = 0)."""
    for t_mix in (0, 1):
        assert all(explorer_share(i, mix_steps=t_mix) == 0.0 for i in range(4))
        assert all(s2l_po_explorer_count(i, 8, mix_steps=t_mix) == 0 for i in range(4))


def test_schedule_options_refuse_bad_values() -> None:
    for kwargs, option in (
        ({"mix_steps": -1}, "mix_steps"),
        ({"mix_steps": 4, "share": 1.5}, "share"),
        ({"mix_steps": 4, "share": -0.1}, "share"),
    ):
        with pytest.raises(OptionError) as info:
            s2l_po_explorer_count(0, 8, **kwargs)
        assert info.value.option == option
    assert algos.get("explorer_schedule", "s2l_po") is s2l_po_explorer_count


# ------------------------------------------------------------------- merged groups, μ of the explorer


def test_merged_group_advantage_is_plain_grpo_with_zero_mean_across_sources() -> None:
    """Property 4: one advantage over the merged group: zero mean over both sources together, not per
    source (a per-source GRPO, the negative control, is not the merged one)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g, dtype=torch.float64)
    groups = torch.arange(3).repeat_interleave(8)
    explorer = torch.tensor(([True] * 6 + [False] * 2) * 3)  # G_w = 6 at step 2 of T_mix = 5
    rewards[explorer] -= 0.5  # the small model's samples are worse: they come out as negatives
    adv = grpo(rewards, groups)
    for k in range(3):
        sel = groups == k
        assert abs(float(adv[sel].mean())) < 1e-6
        assert float(adv[sel & explorer].mean()) < 0 < float(adv[sel & ~explorer].mean())
    per_source = grpo(rewards, groups * 2 + explorer.long())  # GRPO within each source: not the merged one
    assert not torch.allclose(per_source, adv)


def test_behaviour_logp_of_explorer_rows() -> None:
    """ "explorer_logp": μ stays the small model's, so TIS weights the explorer's tokens by π_old/μ_ω;
    "none": μ = π_old on the explorer's rows only (weight 1), the policy's rows untouched."""
    g = torch.Generator().manual_seed(1)
    old, mu = -torch.rand(4, 5, generator=g) * 3, -torch.rand(4, 5, generator=g) * 3
    mask = torch.ones(4, 5)
    rows = torch.tensor([True, True, False, False])
    assert torch.equal(behaviour_logp(mu, old, rows, "explorer_logp"), mu)
    none = behaviour_logp(mu, old, rows, "none")
    assert torch.equal(none[:2], old[:2]) and torch.equal(none[2:], mu[2:])
    w = tis_weights(old, none, mask)
    assert torch.equal(w[:2], torch.ones(2, 5)) and torch.equal(w[2:], tis_weights(old, mu, mask)[2:])
    assert not torch.equal(tis_weights(old, mu, mask)[:2], torch.ones(2, 5))  # the off-policy weights differ
    with pytest.raises(OptionError, match="correction"):
        behaviour_logp(mu, old, rows, "clip")


# ------------------------------------------------------------------------------------ config

TINY = [
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.max_position_embeddings=64",
    "train.num_steps=3",
    "train.seq_length=32",
    "train.micro_batch_size=4",
    "data.synthetic_max_digits=1",
    "data.synthetic_num_prompts=500",
    "rollout.group_size=4",
    "rollout.prompts_per_step=2",
    "rollout.max_new_tokens=6",
    "rollout.context_length=64",
    "algorithm.num_minibatches=1",
    "algorithm.mismatch.name=tis",
    "reward.name=tests.test_s2l_po:char_code_reward",
    "optimizer.lr=1e-3",
    "optimizer.lr_decay_style=constant",
    "init.sft_steps=0",
    "eval.interval=0",
    "eval.at_start=false",
    "eval.num_prompts=2",
    "eval.k=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]
EXPLORER_MODEL = ModelConfig(
    hidden_size=32,
    ffn_hidden_size=64,
    num_layers=1,
    num_attention_heads=4,
    num_query_groups=2,
    max_position_embeddings=64,
)  # smaller than the policy


def char_code_reward(s) -> float:
    """A dense reward even untrained models vary on (the reward runner imports it by name)."""
    return float(sum(map(ord, s.completion)) % 7)


def write_explorer_checkpoint(path: str, seed: int = 7) -> str:
    """An HF checkpoint of the smaller model (the project's reference modeling, `save_pretrained`)."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = McoreRLForCausalLM(hf_config_from_model_config(EXPLORER_MODEL))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # peaked next-token distributions: far from the near-uniform policy's
    model.save_pretrained(path)
    return path


def _literal(message: str) -> str:
    return re.escape(message)


def test_config_keys_load_and_bad_values_name_their_key(tmp_path) -> None:
    ckpt = str(tmp_path / "small")
    os.makedirs(ckpt)
    (tmp_path / "small" / "config.json").write_text("{}")  # validation only looks for config.json
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"rollout:\n  explorer:\n    model_path: {ckpt}\n    share: 0.75\n    mix_steps: 5\n    correction: none\n"
    )
    cfg = load_config(RLConfig, str(path), TINY)
    validate_rl_config(cfg, 1)
    x = cfg.rollout.section(ExplorerConfig)
    assert x.enabled and (x.model_path, x.share, x.mix_steps, x.correction) == (ckpt, 0.75, 5, "none")
    assert not load_config(RLConfig, None, TINY).rollout.section(ExplorerConfig).enabled
    on = [f"rollout.explorer.model_path={ckpt}"]
    bad = [
        (["rollout.explorer.mix_steps=-2"], "rollout.explorer.mix_steps: must be >= 0"),
        (["rollout.explorer.share=1.5"], "rollout.explorer.share: must be in [0, 1]"),
        (["rollout.explorer.schedule=cosine"], "rollout.explorer.schedule: unknown explorer schedule 'cosine'"),
        (["rollout.explorer.urls=['http://127.0.0.1:1']"], "rollout.explorer.urls: the explorer needs either urls"),
        (["rollout.explorer.num_engines=0"], "rollout.explorer.num_engines: must be >= 1"),
        (["rollout.explorer.engine_cores=[[0], [1]]"], "rollout.explorer.engine_cores: needs one entry per engine"),
        (["rollout.explorer.request_timeout_s=0"], "rollout.explorer.request_timeout_s: must be > 0"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=_literal(message)):
            validate_rl_config(load_config(RLConfig, None, TINY + on + overrides), 1)
    # the scheduler mixes the sources in both schedules
    validate_rl_config(load_config(RLConfig, None, TINY + on + ["rollout.runtime=async", "rollout.max_staleness=1"]), 1)
    for overrides, message in [
        (["rollout.explorer.model_path=" + str(tmp_path / "nowhere")], "rollout.explorer.model_path: "),
        (["rollout.explorer.urls=['ftp://x']"], "rollout.explorer.urls[0]: must be an http(s) URL"),
    ]:
        with pytest.raises(ConfigError, match=_literal(message)):
            validate_rl_config(load_config(RLConfig, None, TINY + overrides), 1)
    with pytest.raises(ConfigError, match=_literal("rollout.explorer.correction")):
        load_config(RLConfig, None, TINY + on + ["rollout.explorer.correction=clip"])
    moe = ["model.arch=qwen3_moe", "model.num_experts=4", "algorithm.routing_replay=r3"]
    with pytest.raises(ConfigError, match=_literal("rollout.explorer: routing replay r3 replays the engine's experts")):
        validate_rl_config(load_config(RLConfig, None, TINY + on + moe), 1)


def test_demo_overrides_validate(tmp_path) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckpt = write_explorer_checkpoint(str(tmp_path / "small"))
    cfg = load_config(
        RLConfig,
        os.path.join(here, "configs", "demo.yaml"),
        [f"rollout.explorer.model_path={ckpt}", "rollout.explorer.mix_steps=8"],
    )
    validate_rl_config(cfg, 1)


# ------------------------------------------------------------------------------- in a trainer world


@torch.no_grad()
def _small_model_logp(ckpt: str, samples) -> list[torch.Tensor]:
    from mcore_rl.hf import McoreRLForCausalLM

    model = McoreRLForCausalLM.from_pretrained(ckpt).eval()
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        lp = torch.log_softmax(model(ids).logits.float(), -1)[0]
        p = len(s.prompt_ids)
        out.append(lp[p - 1 : p - 1 + len(s.response_ids)].gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
    return out


def _world(rank: int, world_size: int, tmp: str, ckpt: str) -> None:
    from mcore_rl.runtime import run_rl
    from mcore_rl.runtime.loop import RLRun
    from mcore_rl.train.rl_step import Learner

    cfg = load_config(
        RLConfig,
        None,
        TINY
        + [
            f"run_dir={tmp}/steps",
            f"rollout.explorer.model_path={ckpt}",
            "rollout.explorer.mix_steps=3",
            "rollout.explorer.engine_threads=1",
        ],
    )
    run = RLRun(cfg)
    pids: list[int] = []
    try:
        run.initialise()
        explorer = next(r for r in run.recipes if r.name == "s2l_po").explorer  # the recipe's engines
        pids = [p for p in explorer.pool.processes.pids if p is not None]
        assert len(pids) == 1
        batches = []
        for step, want in enumerate([4, 2, 0, 0]):  # G = 4, T_mix = 3: α = 1, 1/2, 0, 0
            run.state.rl_step = step
            samples, metrics = run.rollouts()
            batches.append(samples)
            groups: dict[int, list] = {}
            for s in samples:
                groups.setdefault(s.group, []).append(s)
            assert len(groups) == 2 and all(len(g) == 4 for g in groups.values())
            for g in groups.values():  # per group: the first G_w from the explorer, the rest the policy's
                assert [s.source for s in g] == ["explorer"] * want + ["policy"] * (4 - want)
                assert all(s.engine.startswith("explorer@http://127.0.0.1:") for s in g[:want])
                assert all(s.engine == "embedded:0" for s in g[want:])
                assert all(s.policy_version == run.state.version for s in g)
            assert metrics["explorer/alpha"] == [1.0, 0.5, 0.0, 0.0][step]
            assert metrics["explorer/samples_frac"] == want / 4
            ours = [s.reward for s in samples if s.source == "explorer"]
            assert ("explorer/reward_mean" in metrics) == bool(ours)
            if ours:
                assert metrics["explorer/reward_mean"] == pytest.approx(sum(ours) / len(ours))
        # the explorer's μ is the small model's log-probs (float32 engine, temperature 1); the policy's is not
        mixed = batches[1]
        ex = [s for s in mixed if s.source == "explorer"]
        pol = [s for s in mixed if s.source == "policy"]
        for s, ref in zip(ex, _small_model_logp(ckpt, ex)):
            torch.testing.assert_close(torch.tensor(s.rollout_logp), ref, rtol=0, atol=1e-4)
        assert any(
            not torch.allclose(torch.tensor(s.rollout_logp), ref, atol=1e-2)
            for s, ref in zip(pol, _small_model_logp(ckpt, pol))
        )
        # the learner on the mixed batch: merged-group GRPO; TIS against μ_ω, or weight 1 with "none"
        learner = Learner(cfg, run.chunks, run.optimizer, run.ref_chunks, run.tokenizer.pad_id)
        per_seq, bm = learner.prepare(mixed, 1)
        rewards = torch.tensor([s.reward for s in mixed])
        gids = torch.tensor([s.group for s in mixed])
        want_adv = grpo(rewards, gids)
        torch.testing.assert_close(per_seq["advantages"].double(), want_adv.double(), rtol=0, atol=1e-5)
        rows = torch.tensor([s.source == "explorer" for s in mixed])
        for k in gids.unique():
            sel = gids == k
            assert abs(float(per_seq["advantages"][sel].mean())) < 1e-5
        n, t = per_seq["old_logp"].shape
        mask = torch.zeros(n, t)
        mu = torch.zeros(n, t)
        for i, s in enumerate(mixed):
            mask[i, : len(s.response_ids)] = 1
            mu[i, : len(s.response_ids)] = torch.tensor(s.rollout_logp)
        want_w = tis_weights(per_seq["old_logp"], mu, mask)
        torch.testing.assert_close(per_seq["is_weights"] * mask, want_w, rtol=1e-6, atol=1e-6)
        assert bm["explorer/k3"] > 1e-3 > bm["mismatch/k3"]  # the small model is far from π; the policy's engine not
        assert {"explorer/is_weight_mean", "explorer/advantage_mean", "explorer/policy_advantage_mean"} <= set(bm)
        learner.cfg.rollout.section(ExplorerConfig).correction = "none"
        per_none, _ = learner.prepare(mixed, 1)
        torch.testing.assert_close(per_none["is_weights"][rows] * mask[rows], mask[rows])
        torch.testing.assert_close(per_none["is_weights"][~rows], per_seq["is_weights"][~rows])
        learner.cfg.rollout.section(ExplorerConfig).correction = "explorer_logp"
        records, _ = learner.train(mixed, 1)  # the loss path with explorer rows
        assert all(math.isfinite(r["train/loss"]) for r in records)
    finally:
        run.close()
    for pid in pids:  # the explorer's process is gone with the run
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    # the sync loop itself: 3 steps, the explorer's share and rewards in every record
    summary = run_rl(
        load_config(
            RLConfig,
            None,
            TINY
            + [
                f"run_dir={tmp}/loop",
                f"rollout.explorer.model_path={ckpt}",
                "rollout.explorer.mix_steps=3",
                "rollout.explorer.engine_threads=1",
            ],
        )
    )
    assert summary["state"]["rl_step"] == 3
    with open(f"{tmp}/loop/metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["explorer/alpha"] for r in recs] == [1.0, 0.5, 0.0]
    assert [r["explorer/samples_frac"] for r in recs] == [1.0, 0.5, 0.0]
    assert ["explorer/reward_mean" in r for r in recs] == [True, True, False]
    assert ["explorer/policy_reward_mean" in r for r in recs] == [False, True, True]
    assert ["explorer/k3" in r for r in recs] == [True, True, False]
    assert all(math.isfinite(r["train/loss"]) for r in recs)


def test_s2l_po_in_a_trainer_world(tmp_path) -> None:
    from tests.world import run_world

    ckpt = write_explorer_checkpoint(str(tmp_path / "small"))
    run_world(1, _world, str(tmp_path), ckpt)
