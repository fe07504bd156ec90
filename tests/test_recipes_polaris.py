"""POLARIS and EDGE-GRPO's guided error correction in the rollout path.

Pure tests of the decisions (`algos/polaris.py`, `algos/edge_gec.py`) and their application to
samples (`recipes/polaris.py`, `recipes/gec.py`), one check of the repairs with the real embedded engine and
reward workers (no megatron), the config keys and their validation, and one short run of the
synchronous loop with every knob on.
"""

from __future__ import annotations

import asyncio

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mcore_rl.algos.edge_gec import KEEP, REFERENCE, REFLECT, gec_ops
from mcore_rl.algos.polaris import histogram, offline_selection, pass_rates, rescue_plan, substitution_plan
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.hooks import active
from mcore_rl.recipes.config.gec import GECConfig
from mcore_rl.recipes.gec import answer_text
from mcore_rl.recipes.polaris import Polaris, RescueBuffer, substitute

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = "rollout.temperature_stages=[{start_step: 0, temperature: 1.0}, {start_step: 2, temperature: 1.3}]"


def _prompt(k: int, text: str = "") -> Prompt:
    return Prompt(k, text or f"p{k}", [1, 2 + k], label=str(k), domain="d")


def _group(k: int, rewards: list[float], version: int = 1, prompt: Prompt | None = None) -> list[Sample]:
    p = prompt or _prompt(k)
    return [
        Sample(p, p.index, [10 + k, 20 + j], [-0.5, -0.25 - j], version, "stop", f"r{k}.{j}", reward=r)
        for j, r in enumerate(rewards)
    ]


# ------------------------------------------------------------------------------------ pass-rate filters


def test_offline_filter_drops_exactly_8_of_8_and_keeps_0_of_8_mirrored_j_never_rises():
    rates = [k / 8 for k in range(9)] * 3 + [0.0] * 5 + [7 / 8] * 9 + [1.0] * 4
    keep = offline_selection(rates)
    assert keep == [i for i, r in enumerate(rates) if r != 1.0]  # 8/8 gone, 0/8 (and all in between) kept
    assert all(i in keep for i, r in enumerate(rates) if r == 0.0)
    j = offline_selection(rates, "mirrored_j", seed=3)
    assert set(j) <= set(keep) and all(i in j for i, r in enumerate(rates) if r == 0.0)
    hist = histogram([rates[i] for i in j])
    assert hist[8] == 0 and hist[0] == 8 and all(a >= b for a, b in zip(hist, hist[1:8]))  # skewed to hard
    assert histogram([rates[i] for i in keep])[7] == 12 > hist[7]  # the easy bin was thinned
    assert offline_selection(rates, "mirrored_j", seed=3) == j  # seeded
    with pytest.raises(ValueError, match="mode"):
        offline_selection(rates, "j")
    # pass rate = #correct / #rollouts, per group
    r = torch.tensor([1.0, 0, 1, 1, 0, 0, 0, 0])
    assert pass_rates(r, torch.tensor([3, 3, 3, 3, 7, 7, 7, 7])) == {3: 0.75, 7: 0.0}


def _stage_config(tmp_path, *extra: str) -> RLConfig:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "label": "x"}) + "\n" for t in ("easy", "almost", "edge", "hard")))
    return load_config(
        RLConfig,
        os.path.join(HERE, "configs", "demo.yaml"),
        [
            f"data.path={path}",
            STAGES,
            "data.drop_solved_above=0.9",
            "rollout.prompts_per_step=4",
            "init.sft_steps=0",
            *extra,
        ],
    )


def test_stage_filter_drops_accuracy_above_0_9_keeps_0_9_and_resumes(tmp_path):
    from mcore_rl.data.domains import stage_temperature
    from mcore_rl.data.prompts import build_prompt_sets
    from mcore_rl.data.tokenizer import load_tokenizer

    cfg = _stage_config(tmp_path)
    validate_rl_config(cfg, 1)
    acc = {"easy": 1.0, "almost": 0.95, "edge": 0.9, "hard": 0.0}

    def stream():
        src = build_prompt_sets(cfg, load_tokenizer(None)).train
        src.set_step(0)
        seen = src.take(4)
        assert {p.text for p in seen} == set(acc) and src.temperature == 1.0
        src.observe([[SimpleNamespace(prompt=p, reward=acc[p.text], reward_error=None)] for p in seen])
        return src

    src = stream()
    state = json.loads(json.dumps(src.state_dict()))  # a checkpoint's copy
    src.set_step(1)
    assert {p.text for p in src.take(8)} == set(acc)  # still stage 0: nothing dropped yet
    src.set_step(2)
    later = src.take(20)
    assert {p.text for p in later} == {"edge", "hard"} and src.temperature == 1.3
    again = stream()
    again.load_state_dict(state)
    again.set_step(1)
    again.take(8)
    again.set_step(2)
    assert [p.text for p in again.take(20)] == [p.text for p in later]  # resumed: the same stream
    # the learner's temperature is the same function of the step (resume-safe)
    assert [stage_temperature(cfg, s) for s in (0, 1, 2, 9)] == [1.0, 1.0, 1.3, 1.3]


# ------------------------------------------------------------------------------------ zero-signal groups


def test_substitution_keeps_the_batch_size_and_leaves_every_group_mixed_by_index_copies():
    groups = [
        _group(0, [1, 1, 1, 1]),
        _group(1, [0, 1, 0, 0]),
        _group(2, [0, 0, 0, 0]),
        _group(3, [1, 0, 1, 1]),
        _group(4, [0, 0, 0, 0]),
        _group(5, [0, 0]),
        _group(6, [1, 1]),
    ]
    before = [[(s.response_ids, s.reward) for s in g] for g in groups]
    rewards = torch.tensor([s.reward for g in groups for s in g])
    ids = torch.tensor([k for k, g in enumerate(groups) for _ in g])
    src = substitution_plan(rewards, ids)
    assert src[:4] == [4, 5, 6, 7] and src[8:12] == [12, 13, 14, 15] and src[16:20] == [4, 5, 6, 7]  # cycling
    assert src[20:] == list(range(20, 24))  # size-2 groups: no mixed group of their size, unchanged
    out, n = substitute(groups)
    assert n == 3 and [len(g) for g in out] == [len(g) for g in groups]
    for k, g in enumerate(out[:5]):
        assert len({s.reward for s in g}) == 2, k  # at least one correct and one wrong
        assert {s.group for s in g} == {k}  # a copy is its own group (the replaced one's id)
    copies = [(s.response_ids, s.reward) for g in out for s in g]
    originals = [x for g in before for x in g]
    assert all(c in originals for c in copies)  # only index copies, nothing new
    assert [s.marks.substituted_from for s in out[0]] == [1] * 4
    assert [s.marks.substituted_from for s in out[2]] == [3] * 4
    assert before == [[(s.response_ids, s.reward) for s in g] for g in groups]  # the input is not changed
    # no mixed group at all: nothing to substitute with
    flat = [_group(0, [1, 1, 1]), _group(1, [0, 0, 0])]
    assert substitute(flat) == (flat, 0)


def test_rescue_gives_an_all_wrong_group_exactly_one_correct_from_the_buffer():
    buf = RescueBuffer(max_prompts=2)
    p = _prompt(7, "seven")
    old = _group(0, [0, 1, 1, 0], version=3, prompt=p)
    assert buf.update([old]) == 2
    assert buf.entries[("d", "seven")].response_ids == old[2].response_ids  # only the latest correct one
    newer = _group(0, [1, 0, 0, 0], version=5, prompt=replace_index(p, 40))
    buf.update([newer])
    stored = buf.entries[("d", "seven")]
    assert len(buf.entries) == 1 and stored.policy_version == 5 and stored.response_ids == newer[0].response_ids
    wrong = _group(0, [0] * 8, version=9, prompt=replace_index(p, 90))
    unbuffered = _group(1, [0] * 8, version=9)
    mixed = _group(2, [0, 1] * 4, version=9, prompt=Prompt(91, "seven", [1, 2], domain="d"))
    out, n = buf.rescue([wrong, unbuffered, mixed])
    assert n == 1
    assert [s.reward for s in out[0]] == [0] * 7 + [1]  # 7 wrong, 1 correct
    rescued = out[0][7]
    assert rescued.marks.rescued and rescued.group == 90 and rescued.prompt.index == 90
    assert rescued.policy_version == 5 and rescued.rollout_logp == stored.rollout_logp  # its own μ and version
    assert out[1] == unbuffered and out[2] == mixed  # no entry / not all wrong: unchanged
    assert buf.update(out) == 4 and buf.entries[("d", "seven")].response_ids == mixed[-1].response_ids  # not rescued
    # the plan itself, and a bounded buffer that forgets the least recently updated prompt
    plan = rescue_plan(torch.tensor([0.0, 0, 0, 0, 1, 0]), torch.tensor([4, 4, 4, 5, 5, 5]), [True] * 6)
    assert plan == {4: 2}
    assert rescue_plan(torch.tensor([0.0, 0]), torch.tensor([4, 4]), [False, False]) == {}
    for k in range(3):
        buf.update([_group(k + 10, [1])])
    assert len(buf.entries) == 2 and ("d", "seven") not in buf.entries
    # the buffer survives a checkpoint (JSON-able state) exactly
    again = RescueBuffer(2)
    again.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert list(again.entries) == list(buf.entries) and list(again.entries.values()) == list(buf.entries.values())


def replace_index(p: Prompt, k: int) -> Prompt:
    from dataclasses import replace

    return replace(p, index=k)


def test_diversity_score_bounds():
    from mcore_rl.data.domains import diversity_score

    one = list(range(12))
    for g in (1, 4, 8):
        assert diversity_score([one] * g) == pytest.approx(1 / g)  # n/(G·n)
    assert diversity_score([list(range(k * 20, k * 20 + 12)) for k in range(8)]) == 1.0
    rng = np.random.default_rng(0)
    for _ in range(20):
        s = diversity_score([list(rng.integers(0, 3, 10)) for _ in range(4)])
        assert 0 < s <= 1


def test_offline_filter_tool_samples_8_rollouts_per_prompt_and_writes_the_kept_prompts(tmp_path, capsys):
    """tools/polaris_filter.py with the built-in demo model: a pass rate per prompt from 8 scored
    rollouts; the written prompts are exactly those the selection keeps."""
    import sys

    sys.path.insert(0, os.path.join(HERE, "tools"))
    from polaris_filter import main

    out = tmp_path / "kept.jsonl"
    report = main(
        [
            os.path.join(HERE, "configs", "demo.yaml"),
            "--out",
            str(out),
            "--num",
            "6",
            "rollout.max_new_tokens=3",
            "rollout.quantization=none",
            "data.synthetic_num_prompts=300",
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert report["prompts"] == 6 and sum(report["histogram"]) == 6 and len(report["histogram"]) == 9
    assert len(rows) == report["kept"] == sum(report["kept_histogram"]) and all(r["pass_rate"] < 1 for r in rows)
    assert report["kept_histogram"][:8] == report["histogram"][:8] and report["kept_histogram"][8] == 0
    assert all(set(r) == {"prompt", "label", "pass_rate"} for r in rows)
    assert json.loads((tmp_path / "kept.jsonl.histogram.json").read_text()) == report
    assert "pass rate | prompts | kept" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ EDGE-GRPO's GEC


def test_gec_op_choice_no_op2_op3_in_an_all_wrong_group_of_8_with_probability_half_to_the_8th():
    trials = 20_000
    none = 0
    counts = np.zeros(4)
    for t in range(trials):
        ops = gec_ops([True] * 8, [(t, j) for j in range(8)], seed=11)
        counts += np.bincount(ops, minlength=4)
        none += all(op == REFLECT for op in ops)
    p = 0.5**8  # 0.0039
    assert abs(none / trials - p) < 4 * np.sqrt(p * (1 - p) / trials), none
    freq = counts / counts.sum()
    assert counts[KEEP] == 0 and np.allclose(freq[1:], [0.5, 0.25, 0.25], atol=0.01)
    # correct responses are never touched; the draw is per response, seeded and reproducible
    assert gec_ops([False, True], [(0, 0), (0, 1)], seed=1)[0] == KEEP
    keys = [(5, j) for j in range(8)]
    assert gec_ops([True] * 8, keys, seed=2) == gec_ops([True] * 8, keys, seed=2)
    assert gec_ops([True] * 8, keys, seed=2)[:3] == gec_ops([True] * 3, keys[:3], seed=2)  # per response
    assert set(gec_ops([True] * 64, [(9, j) for j in range(64)], probs=[0, 0, 1])) == {REFERENCE}
    with pytest.raises(ValueError, match="summing to 1"):
        gec_ops([True], [(0, 0)], probs=[0.5, 0.5, 0.5])
    assert answer_text("240") == "240" and answer_text({"answer": 3}) == "3" and answer_text({"q": 1}) is None


def _engine_manager(*overrides: str):
    from mcore_rl.data.prompts import build_prompt_sets
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.pool import EmbeddedEnginePool
    from mcore_rl.runtime.rollout_manager import RolloutManager, build_reward_runner
    from mcore_rl.runtime.rollouts import PoolBackend
    from tests.helpers import tiny

    cfg = tiny("rollout.quantization=none", "rollout.max_new_tokens=6", "train.seq_length=48", *overrides)
    validate_rl_config(cfg, 1)
    tok = load_tokenizer(None)
    pool = EmbeddedEnginePool.build(
        cfg.model, tok, num=1, quantization="none", max_running_requests=64, context_length=64, seed=0
    )
    sets = build_prompt_sets(cfg, tok)
    manager = RolloutManager(pool, sets.train, build_reward_runner(cfg), cfg)
    return PoolBackend(pool, sets.train, manager.rewards, manager, cfg, recipes=active(cfg)), pool, tok


def _rescue_buffer(recipes) -> RescueBuffer:
    return next(r for r in recipes if isinstance(r, Polaris)).rescue_buffer


def test_gec_and_rescue_with_the_real_embedded_engine_and_reward_workers():
    """An untrained model answers (nearly) everything wrong: op 3 makes every wrong answer the task's
    answer (reward 1) with μ the engine's log-probs of those tokens; ops 1 and 2 condition on the
    repair context and train on the continuation only; rescue brings a stored correct rollout back."""
    backend, pool, tok = _engine_manager(
        "rollout.gec.enabled=true", "rollout.gec.probs=[0, 0, 1]", "rollout.polaris.rescue=true"
    )
    try:
        prompts = backend.prompts.take(4)
        raw = backend.manager.generate(prompts, None, 1.0, 1, train=True)
        wrong = [(k, j) for k, g in enumerate(raw) for j, s in enumerate(g) if s.reward < 1]
        assert wrong  # an untrained model
        fixed = asyncio.run(backend.repair([list(g) for g in raw]))  # the scheduler's group steps
        model = pool.cores[0].model
        for k, j in wrong:
            s = fixed[k][j]
            assert s.marks.corrected_by == "reference" and s.reward == 1.0 and s.prompt.ids == raw[k][j].prompt.ids
            assert s.response_ids == tok.encode(s.prompt.label) + [tok.eos_id]
            ids = torch.tensor([s.prompt.ids + s.response_ids])
            with torch.no_grad():
                logits = model(ids).logits[0].float()
            n = len(s.prompt.ids)
            want = torch.log_softmax(logits[n - 1 : -1], -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(s.rollout_logp), want, atol=1e-4)  # μ: the engine's scoring
        # the buffer holds the policy's own correct rollouts only (not GEC's references)
        assert all(s.marks.corrected_by is None for s in _rescue_buffer(backend.recipes).entries.values())

        backend.cfg.rollout.section(GECConfig).probs = [0.5, 0.5, 0.0]  # ops 1 and 2
        again = asyncio.run(backend.repair([list(g) for g in raw]))
        ops = {s.marks.corrected_by for g in again for s in g}
        assert ops - {None} == {"reflect", "inject"}
        for k, j in wrong:
            s, old = again[k][j], raw[k][j]
            rsp = old.response_ids[:-1] if old.response_ids[-1] == tok.eos_id else old.response_ids
            hint = " Wait!" + (f" The answer is {old.prompt.label}." if s.marks.corrected_by == "inject" else "")
            assert s.prompt.ids == old.prompt.ids + rsp + tok.encode(hint)  # the repair context
            assert s.prompt.text == old.prompt.text and s.group == old.group  # verified against the original
            assert 0 < len(s.response_ids) == len(s.rollout_logp) and all(lp <= 0 for lp in s.rollout_logp)
            assert len(s.prompt.ids) + len(s.response_ids) <= backend.cfg.train.seq_length

        # rescue: a correct rollout of this prompt is stored, then an all-wrong group of it is rescued
        backend.recipes = [r for r in backend.recipes if r.name != "gec"]  # GEC off
        ref = fixed[wrong[0][0]][wrong[0][1]]
        buffer = _rescue_buffer(backend.recipes)
        buffer.entries.clear()
        buffer.update([[Sample(ref.prompt, ref.group, ref.response_ids, ref.rollout_logp, 0, "stop", reward=1.0)]])
        all_wrong = [s for s in raw[wrong[0][0]] if s.reward < 1]
        out = asyncio.run(backend.repair([all_wrong]))
        assert [s.reward for s in out[0]] == [0.0] * (len(all_wrong) - 1) + [1.0] and out[0][-1].marks.rescued
    finally:
        backend.rewards.close()


@pytest.mark.parametrize("rounds", [True, False])
def test_rescue_substitution_and_gec_in_both_schedules(rounds):
    """The group steps (rescue, GEC) and the batch step (substitution) run in the synchronous
    schedule's rounds and in the streaming schedule (a round of one group, max_staleness 1), with
    the real embedded engine and reward workers."""
    from mcore_rl.runtime.rollouts import Rollouts
    from mcore_rl.runtime.scheduler import SchedulerConfig

    backend, pool, tok = _engine_manager(
        "rollout.gec.enabled=true",
        "rollout.gec.probs=[0, 0, 1]",
        "rollout.polaris.rescue=true",
        "rollout.polaris.substitute=true",
    )
    r = backend.cfg.rollout
    cfg = SchedulerConfig(r.group_size, r.prompts_per_step, max_staleness=0 if rounds else 1, rounds=rounds)
    rollouts = Rollouts(pool, backend, cfg)
    try:
        got = rollouts.next_batch(0, 0)
        assert got is not None
        groups, metrics = got
        assert len(groups) == r.prompts_per_step
        fixed = [s for g in groups for s in g if s.marks.corrected_by == "reference"]
        assert fixed and all(s.reward == 1.0 for s in fixed)  # an untrained model: GEC's op 3 fixed them
        # the counts cover every group repaired since the last batch: in the streaming schedule that can
        # include finished groups still buffered for the next batch (more of them on a loaded machine)
        repaired = metrics["rollout/repair/gec_reference"]
        assert repaired == len(fixed) if rounds else repaired >= len(fixed)
        for key in ("rollout/repair/substituted_groups", "rollout/repair/rescue_buffer_prompts"):
            assert key in metrics
        assert ("rollout/rounds" in metrics) == rounds and ("async/staleness_mean" in metrics) != rounds
    finally:
        rollouts.close()
        backend.rewards.close()


# ------------------------------------------------------------------------------------ config


def test_config_keys_load_from_yaml_and_bad_values_name_their_key(tmp_path):
    cfg = _stage_config(
        tmp_path, "rollout.polaris.rescue=true", "rollout.polaris.substitute=true", "rollout.gec.enabled=true"
    )
    validate_rl_config(cfg, 1)
    assert [(s.start_step, s.temperature) for s in cfg.rollout.temperature_stages] == [(0, 1.0), (2, 1.3)]
    cases = {
        "rollout.temperature_stages[1].start_step": "rollout.temperature_stages=[{start_step: 3, temperature: 1.0}, "
        "{start_step: 3, temperature: 1.1}]",
        "rollout.temperature_stages[0].temperature": "rollout.temperature_stages=[{start_step: 0, temperature: 0}]",
        "data.drop_solved_above": "data.drop_solved_above=1.5",
        "rollout.polaris.rescue_buffer_prompts": "rollout.polaris.rescue_buffer_prompts=0",
        "rollout.gec.probs": "rollout.gec.probs=[0.5, 0.5, 0.5]",
        "rollout.gec.answer_hint": "rollout.gec.answer_hint=' {solution}'",
    }
    for key, bad in cases.items():
        with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace(".", r"\.") + ":"):
            validate_rl_config(_stage_config(tmp_path, "rollout.gec.enabled=true", bad), 1)
    demo = os.path.join(HERE, "configs", "demo.yaml")
    # the asynchronous runtime refuses the stages by name (it draws ahead of the learner); the group
    # repairs are the scheduler's group and batch steps in both schedules
    with pytest.raises(ConfigError, match=r"rollout[.]temperature_stages: .*rollout.runtime=sync"):
        validate_rl_config(load_config(RLConfig, demo, ["rollout.runtime=async", STAGES]), 1)
    for on in ("rollout.polaris.rescue=true", "rollout.polaris.substitute=true", "rollout.gec.enabled=true"):
        validate_rl_config(load_config(RLConfig, demo, ["rollout.runtime=async", "rollout.max_staleness=1", on]), 1)
    with pytest.raises(ConfigError, match=r"data\.drop_solved_above: .*needs rollout\.temperature_stages"):
        validate_rl_config(load_config(RLConfig, demo, ["data.drop_solved_above=0.9"]), 1)
    with pytest.raises(ConfigError, match=r"rollout\.gec\.enabled: .*sampling_mask_replay"):
        validate_rl_config(
            load_config(
                RLConfig, demo, ["rollout.gec.enabled=true", "rollout.sampling_mask_replay=true", "rollout.top_k=20"]
            ),
            1,
        )


# ------------------------------------------------------------------------------------ the sync loop


def _loop(rank: int, world_size: int, tmp: str) -> None:
    from megatron.core import dist_checkpointing

    from dataclasses import asdict

    from mcore_rl.runtime import run_rl
    from mcore_rl.runtime.loop import RLRun
    from tests.helpers import _records, tiny

    knobs = [
        "data.synthetic_num_prompts=8",
        "init.sft_steps=20",
        STAGES,
        "data.drop_solved_above=0.9",
        "rollout.polaris.rescue=true",
        "rollout.polaris.substitute=true",
        "rollout.gec.enabled=true",
        "reward.name=tests.recipes_rewards:starts_with_digit",
        "eval.interval=0",
    ]
    cfg = tiny(f"run_dir={tmp}/run", f"checkpoint.save_dir={tmp}/ckpt", "checkpoint.save_interval=3", *knobs)
    run_rl(cfg)
    recs = [r for r in _records(f"{tmp}/run") if "rollout/temperature" in r]
    # rollout step k (logged as rl_step k + 1) samples at its stage's temperature: stage 2 from step 2 on
    assert sorted({(r["rl_step"], r["rollout/temperature"]) for r in recs}) == [(1, 1.0), (2, 1.0), (3, 1.3)]
    for r in recs:
        assert "rollout/repair/substituted_groups" in r and "rollout/repair/rescued_groups" in r
        assert (
            r["rollout/repair/gec_fixed"]
            <= r["rollout/repair/gec_reference"] + r["rollout/repair/gec_inject"] + r["rollout/repair/gec_reflect"]
        )
        assert np.isfinite(r["train/loss"])  # the learner trains on repaired samples (changed contexts, scored μ)
    assert sum(r["rollout/repair/gec_reference"] + r["rollout/repair/gec_inject"] for r in recs) > 0
    # (seeded run) step 3 rescues groups with rollouts of earlier weight versions, which the loop lets through
    # its staleness check and the learner trains on; the pool of 8 prompts comes round every 2 steps
    rescued = [r for r in recs if r["rollout/repair/rescued_groups"] > 0]
    assert rescued and all(r["rollout/policy_version_min"] < r["rl_step"] for r in rescued)
    common = dist_checkpointing.load_common_state_dict(f"{tmp}/ckpt/iter_0000003")["common"]
    buf = common["rl"]["group_repair"]["rescue_buffer"]
    assert 0 < len(buf["entries"]) == recs[-1]["rollout/repair/rescue_buffer_prompts"]
    assert all(e["reward"] >= 1 and e["marks"]["corrected_by"] is None for e in buf["entries"])
    # a resumed run starts with the same buffer
    run = RLRun(tiny(f"run_dir={tmp}/resumed", f"checkpoint.load_dir={tmp}/ckpt", *knobs))
    try:
        run.initialise()
        assert [asdict(s) for s in _rescue_buffer(run.recipes).entries.values()] == buf["entries"]
    finally:
        run.close()


def test_sync_loop_with_every_polaris_knob_and_gec(tmp_path):
    from tests.world import run_world

    run_world(1, _loop, str(tmp_path))
