"""Multi-domain RL (`data.domains`, `data.mixture`): validation, the mixture sampler, reward heads,
reasoning-gym tasks, held-out sets, and real runs with two domains (synchronous and asynchronous).

What is checked:
- bad input fails before training with a message naming the domain and the key: a missing or
  malformed file (file:line), an unknown reward / task / reasoning-gym name, options a reward or
  task refuses, mixture weights that do not sum to a positive number, staged temperatures in the
  asynchronous runtime;
- the interleaving sampler keeps every domain within one prompt of its share at every point of
  the stream; the random one is seeded and has the right proportions; staged schedules (Re-Math's
  sequential stages and refresh, POLARIS's stage temperature, response budget and solved-prompt
  filter: accuracy > 0.9 dropped, 0.9 kept) switch at their steps; the sampler resumes exactly;
- POLARIS's offline pass-rate filter and diversity score properties;
- a reasoning-gym domain is scored by the generator's own scorer, in a reward worker;
- held-out sets never overlap the training (or validation) prompts of their domain;
- the group-relative advantage handles groups of different sizes in one batch;
- end to end: a 2-domain run (sync) logs per-domain reward, eval, length and mismatch, plots and
  TensorBoard them, resumes from a checkpoint with the same numbers; its samples carry their
  domain, their domain's group size and reward heads; the asynchronous runtime does the same.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.data.domains import (
    DOMAIN_SEED_STRIDE,
    MixtureSchedule,
    MixtureSource,
    diversity_score,
    pass_rate_filter,
    solved_prompts,
    stage_temperature,
    task_examples,
)
from mcore_rl.data.files import DataError
from mcore_rl.data.prompts import HELD_OUT_SEED_OFFSET, PromptSource, build_prompt_sets, read_prompt_files
from mcore_rl.data.tokenizer import load_tokenizer
from tests.world import run_world
from tests.helpers import cfg_of, errors_of, recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------ validation


def test_recipe_and_example_config_are_valid(tmp_path):
    validate_rl_config(cfg_of(str(tmp_path), recipe(str(tmp_path))), 1)
    example = load_config(RLConfig, os.path.join(ROOT, "configs", "domains.yaml"))
    validate_rl_config(example, 1)
    assert [d.name for d in example.data.domains] == ["addition", "code", "format"]
    real = load_config(RLConfig, os.path.join(ROOT, "configs", "smollm2_reasoning.yaml"))  # the real-model recipe
    validate_rl_config(real, 1)
    assert {d.reasoning_gym for d in real.data.domains} == {"products", "chain_sum", "gcd"}
    assert all(d.chat_template and d.rewards[0].options == {"extract": "last_number"} for d in real.data.domains)
    real.data.domains[2].rewards[0].options["extract"] = "first"  # a value outside the reward's Literal
    with pytest.raises(
        ConfigError,
        match=r"data\.domains\[2\]\.rewards\[0\]\.options\.extract: .*'first' is not one of "
        r"'auto', 'tag', 'last_number'",
    ):
        validate_rl_config(real, 1)


def test_bad_domains_fail_validation_naming_the_domain_and_key(tmp_path):
    tmp = str(tmp_path)
    data = recipe(tmp)
    data["data"]["domains"][1]["rewards"][0]["name"] = "nope"
    msg = errors_of(cfg_of(tmp, data))
    assert "data.domains[1].rewards[0].name: unknown reward 'nope'" in msg and "domain 'fmt'" in msg

    data = recipe(tmp)
    data["data"]["domains"][1]["rewards"][0]["options"] = {"colour": "red"}
    msg = errors_of(cfg_of(tmp, data))
    assert "data.domains[1].rewards[0].options: domain 'fmt': 'formatting' does not take the options" in msg

    data = recipe(tmp)
    for d in data["data"]["domains"]:
        d["weight"] = 0.0
    assert "data.domains: the mixture weights" in errors_of(cfg_of(tmp, data))
    data = recipe(tmp)
    data["data"]["mixture"]["stages"][1]["weights"] = {"fmt": 0.0, "sum2": 0.0}
    assert "data.mixture.stages[1].weights: must sum to a positive number" in errors_of(cfg_of(tmp, data))
    data = recipe(tmp)
    data["data"]["mixture"]["stages"][1]["weights"] = {"code": 1.0}
    assert "data.mixture.stages[1].weights: unknown domain(s) ['code']" in errors_of(cfg_of(tmp, data))

    data = recipe(tmp)
    data["data"]["domains"][1].pop("task")
    data["data"]["domains"][1]["reasoning_gym"] = "no_such_puzzle"
    msg = errors_of(cfg_of(tmp, data))
    assert "data.domains[1].reasoning_gym: domain 'fmt': unknown reasoning-gym task 'no_such_puzzle'; available:" in msg
    assert "chain_sum" in msg
    data = recipe(tmp)
    data["data"]["domains"][1]["task"] = "calculus"
    assert "data.domains[1].task: unknown task 'calculus'" in errors_of(cfg_of(tmp, data))
    data = recipe(tmp)
    data["data"]["domains"][1]["options"] = {"max_length": 0}
    assert "data.domains[1].options: domain 'fmt': the task refuses its options" in errors_of(cfg_of(tmp, data))
    data = recipe(tmp)
    data["data"]["domains"][1]["path"] = "x.jsonl"
    assert "data.domains[1]: domain 'fmt': needs exactly one source" in errors_of(cfg_of(tmp, data))
    data = recipe(tmp)
    data["data"]["domains"][0]["template"] = "Q:{question}"
    assert "data.domains[0].template: domain 'sum2'" in errors_of(cfg_of(tmp, data))
    data = recipe(tmp)
    data["data"]["domains"][1]["name"] = "sum2"
    assert "data.domains[1].name: domain 'sum2' is defined twice" in errors_of(cfg_of(tmp, data))
    data = recipe(tmp)
    data["data"]["domains"][1]["max_new_tokens"] = 9
    assert "data.domains[1].max_new_tokens: domain 'fmt': must be in [1, rollout.max_new_tokens=4]" in errors_of(
        cfg_of(tmp, data)
    )
    data = recipe(tmp)
    assert "a staged temperature needs rollout.runtime=sync" in errors_of(cfg_of(tmp, data, "rollout.runtime=async"))
    data = recipe(tmp)
    validate_rl_config(cfg_of(tmp, data, "init.sft_steps=5"), 1)  # fmt is a task: the warm start has answers
    data["data"]["domains"] = data["data"]["domains"][:1]
    data["data"]["mixture"] = {}
    assert "init.sft_steps: the SFT warm start trains on the answers of task" in errors_of(
        cfg_of(tmp, data, "init.sft_steps=5")
    )


def test_sft_warm_start_examples_of_the_task_domains(tmp_path):
    """Answers of every task domain, shared by weight, rendered like the rollouts' prompts, never a
    held-out prompt."""
    from mcore_rl.data.domains import build_domain_sets, sft_examples
    from mcore_rl.data.tokenizer import load_tokenizer

    tmp = str(tmp_path)
    data = recipe(tmp)
    data["data"]["domains"].append(
        {
            "name": "add",
            "task": "addition",
            "options": {"max_digits": 2},
            "template": "A:{prompt}",
            "weight": 3.0,
            "eval": {"num_prompts": 50},
        }
    )
    cfg = cfg_of(tmp, data, "init.sft_steps=5")
    tok = load_tokenizer(None)
    sets = build_domain_sets(cfg, tok)
    held = {p.text for p in sets.eval_prompts}
    examples = sft_examples(cfg, tok, 400, cfg.train.seed, held)
    by_domain = {}
    for ex in examples:
        by_domain.setdefault(ex.source.split(":")[0], []).append(ex)
    assert set(by_domain) == {"fmt", "add"}  # sum2 reads a file: its labels are not known to be answers
    assert len(by_domain["add"]) > 2 * len(by_domain["fmt"])  # weights 3 : 1
    assert all(ex.prompt.startswith("A:") and ex.prompt.endswith("=") for ex in by_domain["add"])
    assert all(len(ex.response) == int(ex.prompt.split()[0]) for ex in by_domain["fmt"])
    raw = {ex.prompt[2:] for ex in by_domain["add"]} | {ex.prompt for ex in by_domain["fmt"]}
    assert held and not (raw & held)
    assert [e.source for e in examples] != sorted(e.source for e in examples)  # interleaved, not domain blocks


def test_bad_domain_files_fail_before_training(tmp_path, capsys):
    from mcore_rl.cli import main

    tmp = str(tmp_path)
    data = recipe(tmp)
    data["data"]["domains"][0]["path"] = os.path.join(tmp, "missing.jsonl")
    with pytest.raises(DataError, match=r"data.domains\[0\].path \(domain 'sum2'\): no such file"):
        read_prompt_files(cfg_of(tmp, data))
    # the CLI says so in a second, before any worker starts
    cfg_of(tmp, data, name="missing.yaml")
    assert main(["train", os.path.join(tmp, "missing.yaml")]) == 2
    assert "data.domains[0].path (domain 'sum2'): no such file" in capsys.readouterr().err

    broken = os.path.join(tmp, "broken.jsonl")
    with open(broken, "w") as f:
        f.write('{"prompt": "01+02="}\n{"prompt": 3}\n')
    data["data"]["domains"][0]["path"] = broken
    with pytest.raises(
        DataError,
        match=r"data.domains\[0\].path \(domain 'sum2'\): .*broken.jsonl:2: expected an "
        "object with a string 'prompt'",
    ):
        read_prompt_files(cfg_of(tmp, data))
    garbage = os.path.join(tmp, "garbage.parquet")
    with open(garbage, "wb") as f:
        f.write(b"not parquet at all")
    data["data"]["domains"][0]["path"] = garbage
    with pytest.raises(DataError, match=r"domain 'sum2'.*garbage.parquet: not a readable parquet file"):
        read_prompt_files(cfg_of(tmp, data))


def test_parquet_domain_and_its_bad_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = str(tmp_path)
    path = os.path.join(tmp, "sum.parquet")
    pq.write_table(pa.table({"prompt": [f"{i:02d}+{i:02d}=" for i in range(20)], "label": list(range(20))}), path)
    data = recipe(tmp)
    data["data"]["domains"][0]["path"] = path
    cfg = cfg_of(tmp, data)
    sets = build_prompt_sets(cfg, load_tokenizer(None))
    assert {p.domain for p in sets.eval_prompts} == {"sum2", "fmt"}
    pq.write_table(pa.table({"prompt": ["01+01=", None]}), path)
    with pytest.raises(DataError, match=r"sum.parquet:2: expected a row with a string column 'prompt'"):
        read_prompt_files(cfg)


# ------------------------------------------------------------------------------------ the sampler


def _sources(tok, names=("a", "b", "c"), n=50):
    return {d: PromptSource([(f"{d}{i}", None) for i in range(n)], tok, seed=k, domain=d) for k, d in enumerate(names)}


def _stage(start, weights=None, **kw):
    return SimpleNamespace(
        start_step=start,
        weights=weights or {},
        temperature=kw.get("temperature"),
        max_new_tokens=kw.get("max_new_tokens"),
        drop_solved_above=kw.get("drop_solved_above"),
    )


def test_interleaved_mixture_keeps_every_domain_within_one_prompt_of_its_share():
    tok = load_tokenizer(None)
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    src = MixtureSource(_sources(tok), MixtureSchedule(weights), seed=0, prompts_per_step=8)
    counts = {d: 0 for d in weights}
    for n in range(1, 401):
        p = src.take(1)[0]
        counts[p.domain] += 1
        assert p.index == n - 1 and p.text.startswith(p.domain)
        for d, w in weights.items():
            assert abs(counts[d] - n * w / 4) <= 1.0, (n, counts)
    # seeded random draws: the same stream for the same seed, proportions within 4 sigma
    draws = [p.domain for p in MixtureSource(_sources(tok), MixtureSchedule(weights), 7, 8, "random").take(4000)]
    again = [p.domain for p in MixtureSource(_sources(tok), MixtureSchedule(weights), 7, 8, "random").take(4000)]
    assert draws == again
    for d, w in weights.items():
        p = w / 4
        assert abs(draws.count(d) - 4000 * p) < 4 * np.sqrt(4000 * p * (1 - p)), d


def test_staged_schedules_switch_at_their_steps():
    """Re-Math: code -> math -> qa one after another, then a short refresh on math; with the step set
    (sync) and from the stream position (async: prompt k is for step k // prompts_per_step)."""
    tok = load_tokenizer(None)
    names = ("code", "math", "qa")
    stages = [
        _stage(0, {"code": 1}),
        _stage(2, {"math": 1}),
        _stage(4, {"qa": 1}),
        _stage(6, {"math": 1}, temperature=1.3, max_new_tokens=3),
    ]
    schedule = MixtureSchedule({d: 1.0 for d in names}, stages)
    expect = ["code", "code", "math", "math", "qa", "qa", "math"]
    sync = MixtureSource(_sources(tok, names), schedule, 0, prompts_per_step=4)
    for step, d in enumerate(expect):
        sync.set_step(step)
        got = sync.take(4)
        assert {p.domain for p in got} == {d}
        assert all(p.max_new_tokens == (3 if step == 6 else None) for p in got)
        assert sync.temperature == (1.3 if step == 6 else None)
    stream = MixtureSource(_sources(tok, names), schedule, 0, prompts_per_step=4)
    assert [p.domain for p in stream.take(28)] == [d for d in expect for _ in range(4)]
    cfg = SimpleNamespace(
        data=SimpleNamespace(domains=[1], mixture=SimpleNamespace(stages=stages)),
        rollout=SimpleNamespace(temperature=1.0, temperature_stages=[]),
    )
    assert [stage_temperature(cfg, s) for s in (0, 5, 6, 9)] == [1.0, 1.0, 1.3, 1.3]


def test_mixture_sampler_resumes_exactly_across_stages_and_filters():
    tok = load_tokenizer(None)
    stages = [_stage(0), _stage(3, {"a": 1, "b": 3}, drop_solved_above=0.5)]

    def make(sampling):
        return MixtureSource(_sources(tok, ("a", "b"), n=12), MixtureSchedule({"a": 1, "b": 1}, stages), 5, 4, sampling)

    for sampling in ("interleave", "random"):
        a = make(sampling)
        first = a.take(10)
        a.observe([[SimpleNamespace(prompt=p, reward=float(k % 2), reward_error=None)] for k, p in enumerate(first)])
        state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint holds survives serialisation
        rest = [(p.domain, p.text, p.index) for p in a.take(30)]
        b = make(sampling)
        b.load_state_dict(state)
        assert [(p.domain, p.text, p.index) for p in b.take(30)] == rest
        assert any(a.dropped.values()) and a.dropped == b.dropped
    with pytest.raises(ValueError, match="the domains changed since the checkpoint"):
        MixtureSource(_sources(tok, ("a", "c")), MixtureSchedule({"a": 1, "c": 1}), 5, 4).load_state_dict(state)


def test_polaris_stage_filter_offline_filter_and_diversity():
    # property 1: the stage filter drops exactly accuracy > 0.9 (0.9 kept); offline: 8/8 dropped, 0/8 kept
    acc = {"easy": 1.0, "almost": 0.95, "edge": 0.9, "hard": 0.0}
    assert solved_prompts(acc, 0.9) == {"easy", "almost"}
    assert pass_rate_filter({"p8": 8 / 8, "p0": 0 / 8, "p3": 3 / 8}) == {"p0", "p3"}
    tok = load_tokenizer(None)
    pool = [(t, None) for t in acc]
    src = MixtureSource(
        {"m": PromptSource(pool, tok, 0, domain="m")},
        MixtureSchedule({"m": 1.0}, [_stage(0), _stage(1, drop_solved_above=0.9)]),
        0,
        4,
    )
    src.set_step(0)
    seen = src.take(4)
    src.observe([[SimpleNamespace(prompt=p, reward=acc[p.text], reward_error=None)] for p in seen])
    src.set_step(1)
    assert {p.text for p in src.take(20)} == {"edge", "hard"}
    # property 4: the diversity score is in (0, 1]; G identical copies of n distinct 4-grams: 1/G; disjoint: 1
    one = list(range(10))
    assert diversity_score([one] * 4) == pytest.approx(1 / 4)
    assert diversity_score([list(range(k * 10, k * 10 + 10)) for k in range(4)]) == 1.0
    assert 0 < diversity_score([[1, 1, 1, 1, 1, 2]]) <= 1


# ------------------------------------------------------------------------------------ rewards, tasks, sets


def test_reasoning_gym_domain_scored_by_its_own_scorer_in_a_worker():
    from mcore_rl.data.tasks import get_task
    from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, get_reward_fn

    task = get_task("reasoning_gym", dataset="chain_sum", min_terms=2, max_terms=2)
    ((question, entry),) = task.rl_examples(1, seed=3)
    assert entry["question"] == question and entry["metadata"]["source_dataset"] == "chain_sum"
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'nope'; available: .*basic_arithmetic"):
        get_task("reasoning_gym", dataset="nope")
    with pytest.raises(TypeError):
        get_task("reasoning_gym", dataset="chain_sum", bogus=1)
    runner = RewardRunner(RewardFunction(get_reward_fn("reasoning_gym"), timeout_s=60))
    try:
        assert runner.isolation == "process"
        got = runner.score_sync(
            [
                RewardInput(question, f"<answer>{entry['answer']}</answer>", entry),
                RewardInput(question, entry["answer"] + "<|endoftext|>", entry),
                RewardInput(question, "no idea", entry),
                RewardInput(question, "1", "not an entry"),
            ]
        )
    finally:
        runner.close()
    assert [r.reward for r in got[:3]] == [1.0, 1.0, 0.0] and got[3].error is not None


def test_weighted_reward_heads_with_options_in_workers(tmp_path):
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.runtime.rollout_manager import build_reward_runner

    cfg = cfg_of(str(tmp_path), recipe(str(tmp_path)))
    rewards = build_reward_runner(cfg)
    try:
        add, fmt = Prompt(0, "12+34=", [], None, "sum2"), Prompt(1, "3 digits #5:", [], None, "fmt")
        samples = [
            Sample(add, 0, [], [], 1, "stop", "64"),
            Sample(add, 0, [], [], 1, "stop", "65"),
            Sample(fmt, 1, [], [], 1, "stop", "1234"),
            Sample(fmt, 1, [], [], 1, "stop", "12"),
        ]
        rewards.score_sync(samples)
    finally:
        rewards.close()
    assert [s.reward_heads for s in samples[:2]] == [{"addition": 1.0}, {"addition": 0.0}]
    # pattern [0-9]{1,3} (an option) fails "1234"; digit_count weighs 0.25
    assert samples[2].reward_heads == {"formatting": 0.0, "tests.reward_fns:digit_count": 4.0}
    assert samples[3].reward_heads == {"formatting": 1.0, "tests.reward_fns:digit_count": 2.0}
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 1.5] and all(s.reward_error is None for s in samples)


def test_held_out_sets_are_disjoint_from_training(tmp_path):
    tmp = str(tmp_path)
    data = recipe(tmp)
    data["data"]["domains"][1]["eval"]["seed"] = 1234 + DOMAIN_SEED_STRIDE  # fmt's training seed: the same draws
    data["data"]["domains"].append(
        {
            "name": "chain",
            "reasoning_gym": "chain_sum",
            "num_prompts": 40,
            "options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
            "eval": {"num_prompts": 30},  # 30 draws of ~100 questions repeat some: the set must not
        }
    )
    cfg = cfg_of(tmp, data, "train.seq_length=128", "model.max_position_embeddings=128")
    validate_rl_config(cfg, 1)
    sets = build_prompt_sets(cfg, load_tokenizer(None))
    chain = [p.text for p in sets.eval_prompts if p.domain == "chain"]
    assert len(chain) == len(set(chain)) == 30
    chain_seed = 1234 + HELD_OUT_SEED_OFFSET + 2 * DOMAIN_SEED_STRIDE
    assert len({x[0] for x in task_examples(cfg.data.domains[2], 30, chain_seed)}) < 30  # the raw draw repeats
    raw = {x[0] for x in task_examples(cfg.data.domains[1], 200, 1234 + DOMAIN_SEED_STRIDE)}
    assert {p.text for p in sets.eval_prompts if p.domain == "fmt"} <= raw  # they overlapped before removal
    for d in ("sum2", "fmt", "chain"):
        held = {p.text for p in sets.eval_prompts if p.domain == d}
        assert held, d
        for stream in (sets.train, sets.validation):
            pool = {x[0] for x in stream.sources[d].pool}
            assert pool and not held & pool, d
    assert {p.domain for p in sets.eval_prompts} == {"sum2", "fmt", "chain"}
    assert len({p.index for p in sets.eval_prompts}) == len(sets.eval_prompts)
    # the file domain's template reaches the ids, not the text the reward reads
    p = sets.train.sources["sum2"].take(1)[0]
    assert p.ids[1:] == load_tokenizer(None).encode("Q:" + p.text)


def test_chat_template_domain_renders_with_the_tokenizers_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tmp = str(tmp_path)
    raw = Tokenizer(
        models.WordLevel({"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3, "user": 4, "system": 5}, unk_token="<unk>")
    )
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    hf.save_pretrained(os.path.join(tmp, "tok"))
    data = recipe(tmp)
    data["data"]["domains"][0].pop("template")
    data["data"]["domains"][0].update(chat_template=True, system_prompt="be brief")
    data["data"]["tokenizer_path"] = os.path.join(tmp, "tok")
    cfg = cfg_of(tmp, data, "model.vocab_size=6")
    validate_rl_config(cfg, 1)
    tok = load_tokenizer(cfg.data.tokenizer_path)
    p = build_prompt_sets(cfg, tok).train.sources["sum2"].take(1)[0]
    want = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": p.text}])
    assert want.startswith("system be brief user ") and p.ids == [tok.bos_id] + tok.encode(want)
    # a template that starts with the bos itself (SmolLM2's <|im_start|>, Llama 3's <|begin_of_text|>) gets no second one
    hf.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    hf.save_pretrained(os.path.join(tmp, "tok"))
    tok = load_tokenizer(cfg.data.tokenizer_path)
    p = build_prompt_sets(cfg, tok).train.sources["sum2"].take(1)[0]
    assert p.ids[:2] == [tok.bos_id, tok.encode("system")[0]] and p.ids.count(tok.bos_id) == 1
    data["data"].pop("tokenizer_path")
    assert "data.domains[0].chat_template: domain 'sum2': needs a Hugging Face tokenizer" in errors_of(
        cfg_of(tmp, data)
    )


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_relative_advantages_with_groups_of_different_sizes(name):
    """Domains with group sizes 2, 4 and 3 in one batch: each group is normalised on its own, as if alone."""
    from mcore_rl.algos import registry

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2, 2])
    fn = registry.get("advantage", name)
    ones = lambda n: torch.ones(n, dtype=torch.bool)
    adv = fn(rewards, groups, normalize_std=True, valid=ones(9))
    for g in range(3):
        alone = fn(
            rewards[groups == g],
            torch.zeros(int((groups == g).sum()), dtype=torch.long),
            normalize_std=True,
            valid=ones(int((groups == g).sum())),
        )
        torch.testing.assert_close(adv[groups == g], alone)
        r = rewards[groups == g].double()
        n = len(r)
        want = {
            "grpo": (r - r.mean()) / (r.std() + 1e-6),
            "dr_grpo": r - r.mean(),
            "rloo": (r - r.mean()) * n / (n - 1),
        }[name]
        torch.testing.assert_close(adv[groups == g].double(), want, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ end to end


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


PER_DOMAIN = (
    "reward/{}/mean",
    "response/{}/length_mean",
    "mismatch/{}/k3",
    "mismatch/{}/abs_logp_diff",
    "rollout/{}/samples",
)


def _check_domain_records(recs: list[dict], domains: tuple[str, ...]) -> None:
    steps = [r for r in recs if "train/loss" in r]
    evals = [r for r in recs if "eval/score" in r]
    for d in domains:
        assert any(all(k.format(d) in r for k in PER_DOMAIN) for r in steps), d
        assert all(f"eval/{d}/score" in r for r in evals), d
    for r in evals:
        assert r["eval/score"] == pytest.approx(np.mean([r[f"eval/{d}/score"] for d in domains]))


def _runs(rank: int, world_size: int, tmp: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.engine.driver import EngineDriver
    from mcore_rl.rollout.server import EngineServer, ServerThread
    from mcore_rl.runtime import run_rl
    from mcore_rl.runtime.loop import RLRun

    data = recipe(tmp)
    ckpt = os.path.join(tmp, "ckpt")
    # 1. sync: 3 steps, stage 2 (fmt only, 2 tokens, temperature 1.2) from step 2, checkpoint at step 2
    run_rl(cfg_of(tmp, data, f"run_dir={tmp}/a", f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2"))
    recs = _records(f"{tmp}/a")
    _check_domain_records(recs, ("sum2", "fmt"))
    last = [r for r in recs if r["rl_step"] == 3 and "train/loss" in r][-1]
    assert "reward/sum2/mean" not in last and last["rollout/fmt/samples"] == 4 * 2  # stage 2: 4 fmt prompts x G=2
    assert last["response/fmt/length_mean"] <= 2  # the stage's response budget
    first = [r for r in recs if r["rl_step"] == 1 and "train/loss" in r][-1]
    assert first["rollout/sum2/samples"] == 2 * 4 and first["rollout/fmt/samples"] == 2 * 2  # 2 + 2 prompts
    assert "reward/fmt/head/formatting" in first and "reward/fmt/head/tests.reward_fns:digit_count" in first
    assert os.path.exists(f"{tmp}/a/curves.png")
    tb = EventAccumulator(os.path.join(tmp, "a", "tensorboard"))
    tb.Reload()
    assert {"reward/sum2/mean", "eval/fmt/score", "mismatch/fmt/k3"} <= set(tb.Tags()["scalars"])

    # 2. resumed from step 2: the sampler continues where it was, so step 3 has the same numbers
    run_rl(cfg_of(tmp, data, f"run_dir={tmp}/b", f"checkpoint.load_dir={ckpt}/iter_0000002"))
    resumed = [r for r in _records(f"{tmp}/b") if r["rl_step"] == 3]
    again = [r for r in recs if r["rl_step"] == 3]
    assert len(resumed) == len(again) > 0
    for x, y in zip(resumed, again):
        for key in ("reward/mean", "reward/fmt/mean", "response/fmt/length_mean", "rollout/fmt/samples"):
            if key in y:
                assert x[key] == y[key], key

    # 3. the samples themselves: their domain, its group size, its reward heads and their weighted sum
    run = RLRun(cfg_of(tmp, data, f"run_dir={tmp}/c"))
    try:
        run.initialise()
        samples, _ = run.rollouts()
        by_domain: dict[str, dict[int, int]] = {}
        for s in samples:
            by_domain.setdefault(s.prompt.domain, {}).setdefault(s.group, 0)
            by_domain[s.prompt.domain][s.group] += 1
        assert {d: sorted(g.values()) for d, g in by_domain.items()} == {"sum2": [4, 4], "fmt": [2, 2]}
        for s in samples:
            heads = {"sum2": {"addition": 1.0}, "fmt": {"formatting": 1.0, "tests.reward_fns:digit_count": 0.25}}
            w = heads[s.prompt.domain]
            assert set(s.reward_heads) == set(w)
            assert s.reward == pytest.approx(sum(w[k] * v for k, v in s.reward_heads.items()))
            assert s.provenance()["domain"] == s.prompt.domain
    finally:
        run.close()

    # 4. the asynchronous runtime (an engine server on loopback): per-domain metrics, domains on the samples
    data["data"]["mixture"]["stages"][1].pop("temperature")  # a staged temperature needs the sync runtime
    cfg = cfg_of(
        tmp,
        data,
        f"run_dir={tmp}/async",
        "rollout.runtime=async",
        "train.num_steps=2",
        "eval.interval=0",
        "logging.tensorboard=false",
    )
    core = EngineCore(
        McoreRLForCausalLM(hf_config_from_model_config(cfg.model)),
        load_tokenizer(None),
        context_length=64,
        quantization="fp8",
    )
    server = ServerThread(EngineServer(EngineDriver(core)))
    cfg.rollout.engine_urls = [server.start()]
    try:
        summary = run_rl(cfg)
    finally:
        server.stop()
    recs = _records(f"{tmp}/async")
    _check_domain_records(recs, ("sum2", "fmt"))
    steps = {r["rl_step"]: r for r in recs if "async/staleness_max" in r}  # one batch per rollout step
    assert [r["rollout/sum2/samples"] + r["rollout/fmt/samples"] for r in steps.values()] == [2 * 4 + 2 * 2] * 2
    assert summary["accounting"]["balanced"] and summary["accounting"]["trained"] == 2 * 4


def test_two_domain_runs_sync_resume_and_async(tmp_path):
    run_world(1, _runs, str(tmp_path))


# ------------------------------------------------------------------------------ held-out scoring


def test_held_out_accuracy_counts_right_by_each_domains_threshold(tmp_path):
    """A judge's 0-9 domain is right at >= 7 (its `eval.correct_threshold`), a 0/1 verifier's at >= 1
    (`eval.correct_threshold`, default 1): neither the judge's 5 nor the verifier's 0.5 is right."""
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.runtime.evaluate import domain_threshold, evaluate

    data = recipe(str(tmp_path))
    data["data"]["domains"][1]["name"] = "judged"  # as if scored 0-9 by a judge
    data["data"]["domains"][1]["eval"]["correct_threshold"] = 7
    data["data"]["domains"][0]["name"] = "verified"
    data["data"]["mixture"]["stages"][1]["weights"] = {"judged": 1.0}
    cfg = cfg_of(str(tmp_path), data, "eval.k=2")
    assert domain_threshold(cfg, "judged") == 7 and domain_threshold(cfg, "verified") == 1.0
    prompts = [Prompt(i, "1+1=", [1], "2", domain) for i, domain in enumerate(["judged", "judged", "verified"])]
    rewards = {0: [8.0, 9.0, 5.0], 1: [5.0, 5.0, 7.0], 2: [1.0, 0.5, 1.0]}  # greedy, then two samples

    class Served:  # what the engines returned for these prompts (the scoring is under test)
        temperature = 1.0

        def generate(self, ps, n, temperature, salt, on_done=None):
            first = 0 if n == 1 else 1
            return [
                [Sample(p, p.index, [1], [0.0], 0, "stop", reward=rewards[p.index][first + j]) for j in range(n)]
                for p in ps
            ]

    out = evaluate(Served(), prompts, cfg)
    assert out["eval/judged/greedy_pass@1"] == 0.5  # 8 right, 5 wrong
    assert out["eval/judged/avg@2"] == 0.5  # 9 and 7 right of 9, 5, 5, 7
    assert out["eval/verified/greedy_pass@1"] == 1.0 and out["eval/verified/avg@2"] == 0.5
    assert out["eval/greedy_pass@1"] == pytest.approx(2 / 3)  # pooled, each prompt by its domain's threshold
    assert out["eval/judged/greedy_reward"] == 6.5
