"""A process reward model in use: per-step scores read at the step delimiters of the policy's tokens,
PROF-GRPO's filter reading them as reward heads, BetaPRM's adaptive best-of-N over candidates
sampled from a real engine."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algos.beta_prm import adaptive_stop, beta_head, beta_std
from mcore_rl.algos.prof_grpo import prof_grpo
from mcore_rl.rewards.base import RewardFunction, RewardInput, RewardRunner
from mcore_rl.rewards.registry import get_reward_fn
from mcore_rl.rewards.process_reward import (
    adaptive_best_of_n,
    candidate_belief,
    load_prm,
    prm_score,
    step_ends,
    steps_as_read,
)

NL, EOS, PAD = 10, 2, 0  # the step delimiter "\n" (one id here), end of text, padding


@pytest.fixture(scope="module")
def engine():
    from mcore_rl.rollout.engine.core import EngineCore

    return EngineCore.from_model_path(None, max_running_requests=8, context_length=128, random_seed=0)


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory, engine) -> str:
    """A tiny two-label classifier (BetaPRM's mean and concentration) reading the engine's vocabulary."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=engine.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    config.num_labels = 2
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(20)  # beliefs spread over (0, 1), not all near ½
    path = str(tmp_path_factory.mktemp("prm") / "hf")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _sample(prompt: list[int], response: list[int]) -> RewardInput:
    return RewardInput("p", "c", metadata={"prompt_ids": prompt, "response_ids": response})


def test_steps_end_at_each_delimiter():
    assert step_ends([5, 6, NL, 7, NL], [NL]) == [2, 4]
    # text after the last delimiter is a last step, read with the delimiter appended (as rm-train reads it)
    assert steps_as_read([5, 6, NL, 7, 8], [NL]) == ([5, 6, NL, 7, 8, NL], [2, 5])
    assert steps_as_read([5, NL, 7, EOS], [NL], eos_id=EOS) == ([5, NL, 7, NL], [1, 3])  # eos is no step
    assert steps_as_read([5, NL, EOS], [NL], eos_id=EOS) == ([5, NL], [1])
    assert step_ends([5, 3, 4, 6, 3, 4], [3, 4]) == [2, 5]  # a multi-token delimiter: its last token
    assert steps_as_read([5, 3, 4, 6], [3, 4]) == ([5, 3, 4, 6, 3, 4], [2, 5])
    assert step_ends([EOS], [NL], eos_id=EOS) == []


def test_a_policy_response_is_read_where_rm_train_reads_its_steps(engine, prm_dir):
    """One rule on both sides: a response whose last step has no delimiter (the shipped tasks' one-line
    answers) gets the beliefs at the positions `rm-train` reads (`process_ids`: every step ends with
    the delimiter, read at its last token), not one token earlier."""
    import asyncio

    from mcore_rl.data.process_rewards import process_ids
    from mcore_rl.rewards.process_reward import step_beliefs

    prm, tok = load_prm(prm_dir), engine.tokenizer
    model = prm.scorer.model
    trained, at = process_ids("12+30=", ["40+2", "42"], "\n", tok)  # what rm-train reads
    prompt = process_ids("12+30=", [], "\n", tok)[0]
    for response in (tok.encode("40+2\n42"), tok.encode("40+2\n42") + [EOS], tok.encode("40+2\n42\n")):
        got = asyncio.run(step_beliefs(prm, prompt, response, tok.encode("\n"), EOS))
        with torch.no_grad():
            values = model.score(model.model(torch.tensor([trained])).last_hidden_state)[0]
        mu, kappa = beta_head(values[at])
        assert got.mean.tolist() == pytest.approx(mu.tolist(), abs=1e-5)
        assert got.std.tolist() == pytest.approx(beta_std(mu, kappa).tolist(), abs=1e-5)
    # the old reading (the last step at its own last token) differs: the test can tell them apart
    assert float(beta_head(values[at[-1] - 1])[0]) != pytest.approx(float(mu[-1]), abs=1e-3)


def test_prm_scores_each_step_and_prof_keeps_the_consistent_ones(prm_dir):
    """The `prm` head is the mean step belief μ_t read at each delimiter (as a hand-run forward gives
    it); `prm_steps` counts the steps; PROF-GRPO's filter ranks a group's correct answers by it."""
    assert get_reward_fn("prm") is prm_score
    prm = load_prm(prm_dir)
    model = prm.scorer.model
    group = [
        _sample([1, 20, 21], [30, 31, NL, 32, NL, EOS]),
        _sample([1, 20, 21], [33, NL, 34, 35, NL, 36, EOS]),
        _sample([1, 20, 21], [37, 38, 39, NL, EOS]),
        _sample([1, 20, 21], [40, NL, 41, NL, EOS]),
    ]
    options = {"model_dir": prm_dir, "step_delimiter_ids": [NL], "eos_token_id": EOS}
    before = prm.batcher.batches
    results = RewardRunner(RewardFunction(prm_score, options=options)).score_sync(group, [0] * 4)
    assert prm.batcher.batches == before + 1  # the group: one forward
    means = []
    for r, s in zip(results, group):
        assert r.error is None, r.error
        response, at = steps_as_read(s.metadata["response_ids"], [NL], EOS)
        ids, ends = s.metadata["prompt_ids"] + response, [3 + e for e in at]
        with torch.no_grad():
            values = model.score(model.model(torch.tensor([ids])).last_hidden_state)[0]
        mu, kappa = beta_head(values[ends])
        assert r.info["step_mean"] == pytest.approx(mu.tolist(), abs=1e-5)
        assert r.info["step_std"] == pytest.approx(beta_std(mu, kappa).tolist(), abs=1e-5)
        assert r.reward == pytest.approx(float(mu.mean()), abs=1e-5)
        means.append(r.reward)
    steps = get_reward_fn("prm_steps")  # registered, as `prm` is
    counts = [steps(s, step_delimiter_ids=[NL], eos_token_id=EOS) for s in group]
    assert counts == [2.0, 3.0, 1.0, 2.0]
    # an id the PRM cannot read scores the worst outcome (`refused_score`, else μ's 0), never a reward
    # error that would leave the sample out of the loss
    bad = RewardRunner(RewardFunction(prm_score, options=options)).score_sync([_sample([1], [99999, NL])])
    assert bad[0].error is None and bad[0].reward == 0.0
    assert "outside the process reward model's vocabulary" in bad[0].info["refused"]
    low = RewardRunner(RewardFunction(prm_score, options={**options, "refused_score": -1.0}))
    assert low.score_sync([_sample([1], [99999, NL])])[0].reward == -1.0

    # PROF-GRPO (keep 2 of 4: one correct, one wrong) reads the heads: the correct answer kept is the
    # one with the higher mean PRM score
    outcome = torch.tensor([1.0, 1.0, 0.0, 0.0])
    heads = torch.tensor([[m, c] for m, c in zip(means, counts)], dtype=torch.float64)
    keep = prof_grpo(
        outcome, torch.zeros(4, dtype=torch.long), reward_heads=heads, head_names=["prm", "prm_steps"], keep=2
    )
    assert keep.sum() == 2 and bool(keep[:2].any()) and bool(keep[2:].any())
    assert bool(keep[0]) == (means[0] > means[1])


def test_adaptive_best_of_n_draws_from_an_engine_and_stops_by_the_rule(engine, prm_dir):
    from mcore_rl.rollout.engine.core import Request
    from mcore_rl.rollout.engine.sampling import SamplingParams

    prm = load_prm(prm_dir)
    prompt = [1] + engine.tokenizer.encode("12+30=")
    drawn: list[int] = []

    def draw(k: int) -> list[list[int]]:
        """k candidates sampled by the engine, each its own seed."""
        rids = [f"cand-{len(drawn) + i}" for i in range(k)]
        for i, rid in enumerate(rids):
            sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=len(drawn) + i, stop_token_ids=[NL])
            engine.add_request(Request(rid, prompt, sampling))
        out: dict[str, list[int]] = {}
        while len(out) < k:
            out.update({o.rid: o.output_ids for o in engine.step() if o.finished})
        drawn.extend([1] * k)
        return [out[r] for r in rids]

    def score(responses: list[list[int]]) -> list[tuple[float, float]]:
        import asyncio

        from mcore_rl.rewards.process_reward import step_beliefs

        async def all_of() -> list:
            return await asyncio.gather(*(step_beliefs(prm, prompt, r, [NL], EOS) for r in responses))

        return [candidate_belief(b) for b in asyncio.run(all_of())]

    # z = 0: the best mean above every other mean stops after the first batch
    eager = adaptive_best_of_n(draw, score, batch_size=3, max_candidates=12, z=0.0)
    assert eager.rounds == 1 and eager.stopped_early and len(eager.candidates) == 3 == len(drawn)
    assert eager.best == int(torch.argmax(eager.mean))
    # a wide bound never separates the candidates: every candidate is drawn, in batches
    drawn.clear()
    wary = adaptive_best_of_n(draw, score, batch_size=3, max_candidates=7, z=1e3)
    assert (wary.rounds, len(wary.candidates), wary.stopped_early, len(drawn)) == (3, 7, False, 7)
    # in between: it stops exactly at the first round whose candidates the rule separates
    drawn.clear()
    mid = adaptive_best_of_n(draw, score, batch_size=2, max_candidates=10, z=0.5)
    sizes = [min(2 * (r + 1), 10) for r in range(mid.rounds)]
    fired = [adaptive_stop(mid.mean[:n], mid.std[:n], 0.5) for n in sizes]
    assert fired[:-1] == [False] * (len(sizes) - 1)
    assert fired[-1] == mid.stopped_early or len(mid.candidates) == 10


def test_make_prm_counts_labels_each_step_prefix_with_its_continuations(engine, tmp_path):
    """tools/make_prm_counts.py: the policy's solutions cut at the delimiter, N continuations from each
    step's prefix (the ids rm-train reads), K of them the verifier accepts; the file rm-train reads."""
    import json
    import pathlib
    import sys

    from mcore_rl.config.rm_schema import PreferenceDataConfig
    from mcore_rl.data.process_rewards import read_process_file
    from mcore_rl.data.tasks import get_task

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
    from make_prm_counts import prm_counts, split_steps, task_verifier

    assert split_steps("12\n34\n", "\n") == ["12", "34"] and split_steps("5", "\n") == ["5"]
    assert split_steps("", "\n") is None and split_steps("1\n\n2", "\n") is None

    class Recorded:
        """The addition task's prompts, a verifier that records what it reads and answers `verdict`."""

        def __init__(self, verdict: float) -> None:
            self.verdict, self.read = verdict, []

        def score(self, prompt: str, completion: str) -> float:
            self.read.append((prompt, completion))
            return self.verdict

    prompts = [p for p, _ in get_task("addition", max_digits=2).examples(6, 0)]
    tok = engine.tokenizer
    args = dict(rollouts=3, delimiter="0", temperature=1.0, max_new_tokens=6, seed=0)  # "0": steps in digits
    yes, no = Recorded(1.0), Recorded(0.0)
    out, skipped = prm_counts(engine, tok, yes.score, prompts, **args)
    again, _ = prm_counts(engine, tok, no.score, prompts, **args)
    assert len(out) + skipped == 6 and len(out) > 0
    assert [o["steps"] for o in again] == [o["steps"] for o in out]  # seeded: the same solutions
    for o, a in zip(out, again):
        assert o["successes"] == [3] * len(o["steps"]) and a["successes"] == [0] * len(o["steps"])
    # every completion the verifier read is a step prefix's text followed by a continuation
    prefixes = [(o["prompt"], "0".join(o["steps"][: t + 1]) + "0") for o in out for t in range(len(o["steps"]))]
    assert len(yes.read) == 3 * len(prefixes)
    for (prompt, prefix), read in zip([p for p in prefixes for _ in range(3)], yes.read):
        assert read[0] == prompt and read[1].startswith(prefix)
    # with the real verifier: 0 <= K <= N, and the file is what rm-train reads
    verify = task_verifier(get_task("addition", max_digits=2))
    assert verify("07+35=", "24\n junk") == 1.0 and verify("07+35=", "25") == 0.0  # as RL scores it
    real, _ = prm_counts(engine, tok, verify, prompts, **args)
    path = tmp_path / "prm.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in real))
    examples = read_process_file(PreferenceDataConfig(path=str(path), step_delimiter="0"))
    assert [e.steps for e in examples] == [o["steps"] for o in real]
    assert all(0 <= k <= 3 for e in examples for k in e.successes)


def test_uncertain_prefix_best_of_n_continues_from_the_least_certain_step(engine, prm_dir):
    """BetaPRM's adaptive compute with continuation, over a real engine: the first batch from the
    prompt; each later batch continues `prompt + prefix` from the step prefix with the largest σ_t
    among the candidates' steps before their last, each prefix once; the continued candidates share
    the prefix's ids and (a causal PRM) its step beliefs; z = 0 stops after the first batch; one-step
    candidates fall back to drawing from the prompt."""
    import asyncio

    from mcore_rl.algos.beta_prm import most_uncertain_step
    from mcore_rl.rewards.process_reward import step_beliefs, uncertain_prefix_best_of_n

    prm = load_prm(prm_dir)
    prompt, eos = [1] + engine.tokenizer.encode("12+30="), 258
    calls: list[list[int]] = []

    def draw_steps(every: int | None):
        def draw(prefix: list[int], k: int) -> list[list[int]]:
            """k continuations of prompt + prefix by the engine, a delimiter after every `every` tokens."""
            rids = [f"cont-{len(calls)}-{i}" for i in range(k)]
            for i, rid in enumerate(rids):
                sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=100 * len(calls) + i)
                engine.add_request(Request(rid, prompt + prefix, sampling))
            calls.append(list(prefix))
            out: dict[str, list[int]] = {}
            while len(out) < k:
                out.update(
                    {o.rid: [t for t in o.output_ids if t not in (NL, eos)] for o in engine.step() if o.finished}
                )
            if every is None:
                return [out[r] for r in rids]
            return [
                [t for j, x in enumerate(out[r]) for t in ([x, NL] if j % every == every - 1 else [x])] for r in rids
            ]

        return draw

    def score(responses: list[list[int]]) -> list:
        async def all_of() -> list:
            return await asyncio.gather(*(step_beliefs(prm, prompt, r, [NL], eos) for r in responses))

        return list(asyncio.run(all_of()))

    from mcore_rl.rollout.engine.core import Request
    from mcore_rl.rollout.engine.sampling import SamplingParams

    res = uncertain_prefix_best_of_n(draw_steps(2), score, [NL], eos, batch_size=2, max_candidates=8, z=1e3)
    assert (res.rounds, len(res.candidates), res.stopped_early) == (4, 8, False)
    assert calls[0] == [] and res.continued[:2] == [0, 0]
    assert len({tuple(c) for c in calls}) == len(calls)  # no prefix continued twice
    beliefs = score(res.candidates)
    for r in range(1, 4):
        # the prefix of round r: the most uncertain step before the last over rounds < r, not used before
        seen = range(2 * r)
        ends = [step_ends(res.candidates[c], [NL]) for c in seen]
        used = {tuple(p) for p in calls[1:r]}
        available = [
            torch.tensor([t < len(e) - 1 and tuple(res.candidates[c][: e[t] + 1]) not in used for t in range(len(e))])
            for c, e in zip(seen, ends)
        ]
        c, t = most_uncertain_step([beliefs[i].std for i in seen], available)  # type: ignore[misc]
        assert calls[r] == res.candidates[c][: ends[c][t] + 1]
        for i in (2 * r, 2 * r + 1):  # the batch continues it: its ids, its steps, its beliefs
            assert res.candidates[i][: len(calls[r])] == calls[r] and res.continued[i] == t + 1
            assert beliefs[i].mean[: t + 1].tolist() == pytest.approx(beliefs[c].mean[: t + 1].tolist(), abs=1e-5)
    assert res.best == int(torch.argmax(res.mean))
    assert res.mean.tolist() == pytest.approx([float(b.mean[-1]) for b in beliefs], abs=1e-5)

    calls.clear()
    eager = uncertain_prefix_best_of_n(draw_steps(2), score, [NL], eos, batch_size=3, max_candidates=9, z=0.0)
    assert (eager.rounds, len(eager.candidates), eager.stopped_early, calls) == (1, 3, True, [[]])
    calls.clear()  # one step each: nothing to continue, every batch from the prompt
    flat = uncertain_prefix_best_of_n(draw_steps(None), score, [NL], eos, batch_size=2, max_candidates=6, z=1e3)
    assert calls == [[], [], []] and flat.continued == [0] * 6


def test_most_uncertain_step_picks_the_largest_available_sigma():
    from mcore_rl.algos.beta_prm import most_uncertain_step

    std = [torch.tensor([0.1, 0.4, 0.2]), torch.tensor([0.3, 0.4])]
    yes = [torch.ones(3, dtype=torch.bool), torch.ones(2, dtype=torch.bool)]
    assert most_uncertain_step(std, yes) == (0, 1)  # the first on ties
    assert most_uncertain_step(std, [torch.tensor([True, False, True]), yes[1]]) == (1, 1)
    assert most_uncertain_step(std, [torch.zeros(3, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)]) is None
