"""Exact speculative sampling in the embedded engine (`rollout/engine/speculative.py`, `drafts.py`).

The rule first, alone: over 60,000 rows of one small vocabulary, the tokens `verify_position` emits
from deliberately bad drafts (a draft distribution far from the target's, a point mass on a token
outside the target's support) are distributed as the target's processed distribution (chi-square,
fixed seeds); the same harness rejects a rule that resamples from p instead of the residual.

Then the engine: the joint distribution of the first four tokens with speculation (prompt lookup
with a frequency penalty; a draft model with other weights) equals the exact joint of plain
sampling computed from the reference model; at temperature 0 the tokens are plain decoding's,
token for token, through continuous batching, retracts (partial rollouts), a weight load mid-run,
FP8 weights and both drafters; the returned log-probs, sampling masks and routed experts are the
target's.
"""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Any

import pytest
import torch

from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
from mcore_rl.rollout.engine.core import EngineCore, Request, RequestOutput
from mcore_rl.rollout.engine.drafts import NgramDrafter
from mcore_rl.rollout.engine.sampling import BatchSampling, SamplingParams, inverse_cdf, penalize, processed_weights
from mcore_rl.rollout.engine.speculative import NO_DRAFT, SpeculativeSettings, verify_position
from mcore_rl.rollout.launch_flags import LaunchFlagError, parse_server_args
from tests.helpers import TOK, make_engine, ref_logprobs, req, run, tiny_model

NGRAM = SpeculativeSettings("NGRAM", num_steps=3)
STANDALONE = SpeculativeSettings("STANDALONE", num_steps=3)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= the statistic) for counts [K] against probs [K] (cells with probability 0 must be
    empty: any count there is p-value 0); cells expected below 5 are pooled into one."""
    n = counts.sum().item()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big & (probs > 0)].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# ---- the acceptance rule alone ----------------------------------------------------------------

VOCAB_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, -4.0])
ROWS = 60_000
SAMPLED = SamplingParams(temperature=0.8, top_k=6, top_p=0.97)


def _target() -> tuple[torch.Tensor, BatchSampling, torch.Tensor]:
    """(logits [ROWS, V], their controls, the processed target distribution p [V])."""
    logits = VOCAB_LOGITS.expand(ROWS, -1).clone()
    ctl = BatchSampling.of([SAMPLED] * ROWS, len(VOCAB_LOGITS), torch.device("cpu"))
    w = processed_weights(logits[:1], BatchSampling.of([SAMPLED], len(VOCAB_LOGITS), torch.device("cpu")))[0]
    return logits, ctl, w / w.sum()


def _bad_draft() -> torch.Tensor:
    """A draft distribution far from the target: most mass where the target has little or none."""
    return torch.tensor([0.02, 0.03, 0.05, 0.1, 0.3, 0.2, 0.2, 0.1])


def _emitted(rule, draft: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts of the tokens the rule emits at one position, p); drafts drawn from the bad q
    ("model"), or a point mass on token 1 (in p's support) or on token 7 (outside it)."""
    logits, ctl, p = _target()
    g = torch.Generator().manual_seed(0)
    q = _bad_draft()
    if draft == "model":
        drafts, q_rows = torch.multinomial(q, ROWS, replacement=True, generator=g), q.expand(ROWS, -1)
    else:
        drafts, q_rows = torch.full((ROWS,), 1 if draft == "point_in_support" else 7), None
    u = torch.rand(ROWS, 2, generator=g, dtype=torch.float64)
    verdict = rule(logits, ctl, drafts, q_rows, u[:, 0], u[:, 1])
    return torch.bincount(verdict.tokens, minlength=len(p)), p


def _resample_from_target(logits, ctl, drafts, q_rows, u_accept, u_draw):
    """A broken rule: the acceptance test is right, but a rejected draft is replaced by a draw from
    p instead of the residual max(0, p - q)."""
    verdict = verify_position(logits, ctl, drafts, q_rows, u_accept, u_draw)
    redraw = inverse_cdf(processed_weights(logits, ctl), u_draw)
    verdict.tokens = torch.where(verdict.accepted, verdict.tokens, redraw)
    return verdict


@pytest.mark.parametrize("draft", ["model", "point_in_support", "point_outside_support"])
def test_emitted_tokens_follow_the_target_distribution(draft: str) -> None:
    counts, p = _emitted(verify_position, draft)
    assert counts[p == 0].sum() == 0  # never outside the support of the processed distribution
    assert chi_square_pvalue(counts, p) > 1e-3
    if draft != "point_outside_support":  # (there every draft is rejected and the residual is p itself)
        broken, _ = _emitted(_resample_from_target, draft)
        assert chi_square_pvalue(broken, p) < 1e-12  # the harness tells a wrong residual apart


def test_greedy_rows_accept_only_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    ctl = BatchSampling.of([SamplingParams(temperature=0.0)] * 3, 3, torch.device("cpu"))
    u = torch.zeros(3, dtype=torch.float64)
    verdict = verify_position(logits, ctl, torch.tensor([1, 2, NO_DRAFT]), None, u, u)
    assert verdict.tokens.tolist() == [1, 1, 1] and verdict.accepted.tolist() == [True, False, False]


def test_prompt_lookup_proposes_the_latest_continuation() -> None:
    d = NgramDrafter(1, 3)
    assert d.lookup([5, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7], 3) == [8, 1, 5]  # the latest match of the 3-gram
    assert d.lookup([1, 2, 3, 4], 2) == []
    assert d.lookup([1, 2, 1], 5) == [2, 1]


# ---- the engine ------------------------------------------------------------------------------


JOINT_VOCAB = 48  # a small vocabulary: every id is in the prompt, so prompt lookup always drafts
# each id once, in a fixed shuffled order: prompt lookup drafts what followed the last token there,
# a draft the model sometimes (rarely) agrees with
JOINT_PROMPT = torch.randperm(JOINT_VOCAB, generator=torch.Generator().manual_seed(0)).tolist()
JOINT_TOKENS = 4
JOINT_SP: dict[str, Any] = dict(temperature=1.0, top_k=3, max_new_tokens=JOINT_TOKENS, ignore_eos=True)


@torch.no_grad()
def exact_joint(
    model: McoreRLForCausalLM, prompt: list[int], sp: SamplingParams, n: int
) -> dict[tuple[int, ...], float]:
    """Plain sampling's exact probability of every n-token continuation of `prompt`: the product of the
    processed conditionals (penalties over the tokens so far, temperature, top-k) of full reference forwards."""
    ctl = BatchSampling.of([sp], model.config.vocab_size, torch.device("cpu"))
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == n:
            out[prefix] = prob
            return
        logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1:].float()
        w = processed_weights(penalize(logits, [sp], [list(prefix)]), ctl)[0].double()
        p = w / w.sum()
        for tok in torch.nonzero(p > 0).squeeze(-1).tolist():
            walk((*prefix, tok), prob * float(p[tok]))

    walk((), 1.0)
    return out


@pytest.mark.parametrize(
    "kind,extra",
    [("NGRAM", dict(frequency_penalty=0.7)), ("STANDALONE", {})],
    ids=["prompt_lookup_with_penalty", "bad_draft_model"],
)
def test_engine_samples_the_exact_joint_distribution(kind: str, extra: dict[str, Any]) -> None:
    """2,000 seeded requests, four tokens each (the first from the prefill, then up to three per
    verification): the joint of the four equals plain sampling's exactly computed one."""
    model = tiny_model(vocab_size=JOINT_VOCAB)
    prompt = JOINT_PROMPT
    sp = SamplingParams(**JOINT_SP, **extra)
    joint = exact_joint(model, prompt, sp, JOINT_TOKENS)
    spec = SpeculativeSettings(kind, num_steps=3)
    draft = tiny_model(7, vocab_size=JOINT_VOCAB)
    engine = make_engine(copy.deepcopy(model), max_running_requests=64, speculative=spec, draft_model=draft)
    n = 2000
    outs = run(engine, [Request(f"r{i}", prompt, SamplingParams(**JOINT_SP, **extra, seed=i)) for i in range(n)])
    stats = engine.spec_stats
    assert stats["drafted"] > n and 0 < stats["accepted"] < stats["drafted"]  # drafts were made and rejected
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1)
    for o in outs.values():
        counts[index.get(tuple(o.output_ids), len(cells))] += 1
    probs = torch.tensor([joint[c] for c in cells] + [0.0])
    assert chi_square_pvalue(counts, probs) > 1e-3


def _greedy_requests(**kw) -> list[Request]:
    """Four plain requests, one whose stop token is masked by min_new_tokens for a while and then ends
    it inside a verified block, one that a stop string ends inside a block."""
    prompts = ["abcabcabcabc", "the cat the cat the cat", "hello", "1+1=2, 1+1=2, 1+1="]
    out = [req(f"r{i}", p, max_new_tokens=24 + 3 * i, temperature=0.0, **kw) for i, p in enumerate(prompts)]
    out.append(
        req("min_new", prompts[1], max_new_tokens=24, temperature=0.0, stop_token_ids=[154, 95], min_new_tokens=10)
    )
    out.append(req("stop_string", prompts[0], max_new_tokens=24, temperature=0.0, stop=["&&"]))
    return out


@functools.cache
def plain_greedy() -> dict[str, RequestOutput]:
    """Plain decoding of `_greedy_requests` (computed once, inside a test: single-threaded)."""
    return run(make_engine(tiny_model()), _greedy_requests())


def near_draft(noise: float = 0.05) -> McoreRLForCausalLM:
    """The target's weights plus noise: a draft model that often, not always, agrees with it."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return model


@pytest.mark.parametrize("spec", [NGRAM, STANDALONE], ids=["ngram", "draft_model"])
@pytest.mark.parametrize("stagger", [0, 2])
def test_greedy_is_plain_decoding_token_for_token(spec, stagger: int) -> None:
    """Temperature 0: the tokens, raw log-probs and top log-probs of plain decoding, with requests
    joining mid-batch (rows with and without drafts in one verification pass)."""
    engine = make_engine(tiny_model(), speculative=spec, draft_model=near_draft())
    outs = run(engine, _greedy_requests(), stagger=stagger)
    assert engine.spec_stats["accepted"] > 0
    # (154 would end it after 8 tokens but is masked; 95 ends it at 19)
    assert plain_greedy()["min_new"].finish_reason == {"type": "stop", "matched": 95}
    assert len(plain_greedy()["min_new"].output_ids) == 19
    assert plain_greedy()["stop_string"].finish_reason == {"type": "stop", "matched": "&&"}
    for rid, want in plain_greedy().items():
        got = outs[rid]
        assert got.output_ids == want.output_ids and got.finish_reason == want.finish_reason
        assert [t for _, t in got.output_token_logprobs] == got.output_ids
        for (a, _), (b, _) in zip(got.output_token_logprobs, want.output_token_logprobs):
            assert a == pytest.approx(b, abs=1e-5)
        assert [[i for _, i in top] for top in got.output_top_logprobs] == [
            [i for _, i in top] for top in want.output_top_logprobs
        ]


def test_sampled_logprobs_and_masks_are_the_targets() -> None:
    """Temperature 1, top-k 5: every returned log-prob is the target's raw log-prob of the sequence
    (one reference forward), and every sampling mask is the top-5 of the target at that position."""
    model = tiny_model()
    engine = make_engine(copy.deepcopy(model), speculative=STANDALONE, draft_model=tiny_model(5))
    reqs = [
        Request(
            f"m{i}",
            TOK.encode("abcabc" * (i + 1)),
            SamplingParams(max_new_tokens=20, temperature=1.0, top_k=5, seed=i, ignore_eos=True),
            return_logprob=True,
            return_sampling_mask=True,
        )
        for i in range(4)
    ]
    outs = run(engine, reqs)
    assert engine.spec_stats["accepted"] > 0
    for r in reqs:
        o = outs[r.rid]
        seq = r.input_ids + o.output_ids
        want = ref_logprobs(model, seq)[len(r.input_ids) - 1 :]
        assert torch.allclose(torch.tensor([lp for lp, _ in o.output_token_logprobs]), want, atol=1e-5)
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, len(r.input_ids) - 1 : -1].float()
        top5 = logits.topk(5, dim=-1).indices.sort(dim=-1).values.tolist()
        assert o.output_token_sampling_mask == top5


def test_partial_rollouts_retract_and_weight_load_mid_run() -> None:
    """Retracts between steps (partial rollouts re-prefilled with their tokens so far) keep plain
    greedy decoding's tokens; a weight load mid-run recomputes the K/V and ends like a plain engine
    given the same load at the same step."""
    for spec in (NGRAM, STANDALONE):
        engine = make_engine(tiny_model(), speculative=spec, draft_model=near_draft())
        for r in _greedy_requests():
            engine.add_request(r)
        outs, steps = {}, 0
        while engine.has_work():
            outs.update({o.rid: o for o in engine.step() if o.finished})
            steps += 1
            if steps % 3 == 0:
                engine.retract()
        assert {k: o.output_ids for k, o in outs.items()} == {k: o.output_ids for k, o in plain_greedy().items()}

    # a weight load while requests run (in place): the tokens after it are the new weights' greedy
    # continuation of each request's tokens before it (a plain engine of the new weights says which)
    other = {n: t for n, t in tiny_model(11).state_dict().items() if "mlp" in n}
    new_model = tiny_model()
    new_model.load_state_dict(other, strict=False)
    for spec in (NGRAM, STANDALONE):
        engine = make_engine(tiny_model(), speculative=spec, draft_model=near_draft())
        reqs = _greedy_requests()
        for r in reqs:
            engine.add_request(r)
        outs = {}
        for step in itertools.count():
            if not engine.has_work():
                break
            if step == 3:
                engine.load_weights(other.items())
                engine.weight_version = 1
            outs.update({o.rid: o for o in engine.step() if o.finished})
        assert engine.recomputed_tokens > 0
        for r in reqs:
            o = outs[r.rid]
            before = o.output_token_weight_versions.count(0)
            assert 0 < before < len(o.output_ids)
            cont = Request(
                "c",
                r.input_ids + o.output_ids[:before],
                SamplingParams(temperature=0.0, max_new_tokens=len(o.output_ids) - before),
            )
            want = run(make_engine(copy.deepcopy(new_model)), [cont])["c"].output_ids
            assert o.output_ids[before:] == want, (spec.algorithm, r.rid)


def test_fp8_engine_greedy_is_plain() -> None:
    plain = run(make_engine(tiny_model(), quantization="fp8"), _greedy_requests())
    spec = run(make_engine(tiny_model(), quantization="fp8", speculative=NGRAM), _greedy_requests())
    assert {k: o.output_ids for k, o in spec.items()} == {k: o.output_ids for k, o in plain.items()}


MOE = ModelConfig.of(
    arch="qwen3_moe",
    vocab_size=384,
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
)


@torch.no_grad()
def _routing_of(model: McoreRLForCausalLM, ids: list[int]) -> torch.Tensor:
    """The experts [len(ids), layers, k] the reference model routes the whole sequence to."""
    taps = [layer.mlp.routing for layer in model.model.layers]
    for tap in taps:
        tap.record = True
    try:
        model(torch.tensor([ids]))
        return torch.stack([tap.routed for tap in taps], dim=1)
    finally:
        for tap in taps:
            tap.record, tap.routed = False, None


def test_routed_experts_are_the_targets() -> None:
    """R3: the experts returned per token are those of the target on the emitted sequence."""
    torch.manual_seed(3)
    model = McoreRLForCausalLM(hf_config_from_model_config(MOE)).float().eval()
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    engine = EngineCore(copy.deepcopy(model), TOK, context_length=128, speculative=STANDALONE, draft_model=draft)
    reqs = [
        Request(
            f"e{i}",
            TOK.encode("xyzxyzxyz" * (i + 1)),
            SamplingParams(max_new_tokens=16, temperature=1.0, seed=i, ignore_eos=True),
            return_routed_experts=True,
        )
        for i in range(3)
    ]
    outs = run(engine, reqs)
    assert 0 < engine.spec_stats["accepted"] < engine.spec_stats["drafted"]
    for r in reqs:
        o = outs[r.rid]
        seq = r.input_ids + o.output_ids
        want = _routing_of(model, seq)[: len(seq) - 1]
        assert torch.equal(torch.from_numpy(o.routed_experts).long(), want.long())


def test_bad_settings_name_the_problem() -> None:
    with pytest.raises(ValueError, match="speculative_algorithm: 'EAGLE'"):
        make_engine(tiny_model(), speculative=SpeculativeSettings("EAGLE"))
    with pytest.raises(ValueError, match="speculative_num_steps"):
        make_engine(tiny_model(), speculative=SpeculativeSettings("NGRAM", num_steps=0))
    with pytest.raises(ValueError, match="needs a draft model"):
        make_engine(tiny_model(), speculative=STANDALONE)
    with pytest.raises(ValueError, match="vocab_size 512 != the target's 384"):
        make_engine(tiny_model(), speculative=STANDALONE, draft_model=tiny_model(vocab_size=512))
    with pytest.raises(ValueError, match="n-gram embeddings"):
        make_engine(tiny_model(ngram_orders=[2], ngram_table_size=101, ngram_num_slices=1), speculative=NGRAM)


def test_serve_flags(tmp_path) -> None:
    args = parse_server_args(["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "5"])
    spec = args.engine_kwargs()["speculative"]
    assert (spec.algorithm, spec.num_steps, spec.ngram_min, spec.ngram_max) == ("NGRAM", 5, 1, 3)
    assert "speculative" not in parse_server_args([]).engine_kwargs()
    for argv, message in [
        (["--speculative-algorithm", "EAGLE"], "^--speculative-algorithm: speculative decoding with EAGLE"),
        (["--speculative-algorithm", "STANDALONE"], "needs --speculative-draft-model-path"),
        (["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "0"], "--speculative-num-steps 0"),
        (["--speculative-draft-model", "/x"], "needs --speculative-algorithm STANDALONE"),
    ]:
        with pytest.raises(LaunchFlagError, match=message):
            parse_server_args(argv)
    # a STANDALONE server loads its draft model from the path, as the target (here: the demo model's
    # tokenizer, a tiny draft of the same vocabulary)
    from tests.helpers import save_tiny_hf_model

    path = save_tiny_hf_model(str(tmp_path / "draft"), 256)
    kw = parse_server_args(
        ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", path, "--device", "cpu"]
    ).engine_kwargs()
    engine = EngineCore.from_model_path(path, max_total_tokens=4096, **kw)
    outs = run(engine, [req("a", "abcabcabc", max_new_tokens=12, temperature=0.0)])
    plain = run(
        EngineCore.from_model_path(path, max_total_tokens=4096),
        [req("a", "abcabcabc", max_new_tokens=12, temperature=0.0)],
    )
    assert outs["a"].output_ids == plain["a"].output_ids and engine.spec_stats["accepted"] > 0


def test_rollout_keys_turn_it_on(tmp_path) -> None:
    """`rollout.speculative_*`: checked before any worker starts, then the embedded engines draft."""
    from mcore_rl.rollout.pool import EmbeddedEnginePool, speculative_flags, speculative_settings
    from tests.helpers import rl, rl_errors, save_tiny_hf_model

    spec = "rollout.speculative_algorithm"
    assert "rollout.speculative_num_steps: must be >= 1, got 0" in rl_errors(
        rl(f"{spec}=ngram", "rollout.speculative_num_steps=0")
    )
    assert any(
        e.startswith("rollout.speculative_draft_model_path: standalone needs")
        for e in rl_errors(rl(f"{spec}=standalone"))
    )
    assert any(
        "--speculative-* flags" in e for e in rl_errors(rl(f"{spec}=ngram", "rollout.engine_urls=[http://127.0.0.1:9]"))
    )
    path = save_tiny_hf_model(str(tmp_path / "draft"), 256)
    keys = (f"{spec}=standalone", f"rollout.speculative_draft_model_path={path}", "rollout.speculative_num_steps=2")
    cfg = rl(*keys)
    assert speculative_flags(cfg.rollout) == [
        "--speculative-algorithm",
        "STANDALONE",
        "--speculative-num-steps",
        "2",
        "--speculative-draft-model-path",
        path,
    ]
    settings = speculative_settings(cfg.rollout)
    mc = copy.deepcopy(cfg.model)
    mc.vocab_size = 384  # the draft's
    pool = EmbeddedEnginePool.build(
        mc, TOK, num=2, quantization="none", max_running_requests=4, context_length=64, seed=0, speculative=settings
    )
    drafters = [core.drafter for core in pool.cores]
    assert all(d is not None for d in drafters) and drafters[0] is not drafters[1]


def test_draft_model_near_the_context_end() -> None:
    """A request at the end of its context next to one far from it: the draft model drafts only
    what each may emit, and writes no position past the context (greedy: plain decoding's tokens)."""
    spec = SpeculativeSettings("STANDALONE", num_steps=4)
    reqs = [
        req("near", list(range(40, 70)), max_new_tokens=20, temperature=0.0),
        req("far", "ab", max_new_tokens=20, temperature=0.0),
    ]
    plain = run(make_engine(tiny_model(), context_length=36), copy.deepcopy(reqs))
    got = run(make_engine(tiny_model(), context_length=36, speculative=spec, draft_model=near_draft()), reqs)
    assert {k: o.output_ids for k, o in got.items()} == {k: o.output_ids for k, o in plain.items()}
    assert len(got["near"].output_ids) == 36 - 30
