"""The embedded engine's core: numerics vs the reference model, batching invariance, sampling,
stop conditions, prompt scoring, abort, validation, weight loading and FP8 mode."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch

from tests.helpers import PROMPTS, TOK, assert_matches_reference, lps, make_engine, ref_logprobs, req, run, tiny_model
from mcore_rl.hf import McoreRLForCausalLM
from mcore_rl.rollout.engine.core import EngineCore, Request, RequestOutput
from mcore_rl.rollout.engine.fp8 import (
    FP8_DTYPE,
    Fp8Linear,
    dequantize_block_fp8,
    quantize_activation_fp8,
    quantize_block_fp8,
)
from mcore_rl.rollout.engine.sampling import SamplingParams


def test_greedy_logprobs_match_reference_forward():
    model = tiny_model()
    ref = copy.deepcopy(model).eval()
    outs = run(
        make_engine(model),
        [req(f"r{i}", p, temperature=0.0, max_new_tokens=12, ignore_eos=True) for i, p in enumerate(PROMPTS)],
    )
    for i, p in enumerate(PROMPTS):
        o = outs[f"r{i}"]
        prompt = TOK.encode(p)
        full = prompt + o.output_ids
        expected = ref_logprobs(ref, full)[len(prompt) - 1 :]
        got = torch.tensor([lp for lp, _ in o.output_token_logprobs])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        # greedy = argmax of the reference distribution, and the top-1 logprob is the chosen one
        assert [t for _, t in o.output_token_logprobs] == o.output_ids
        assert all(top[0][1] == t for top, t in zip(o.output_top_logprobs, o.output_ids))
        assert o.finish_reason == {"type": "length", "length": 12}
        assert o.prompt_tokens == len(prompt) and o.completion_tokens == 12


MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.8, seed=1),
    dict(temperature=1.0, top_p=0.9, seed=2),
    dict(temperature=1.2, top_k=20, seed=3),
    dict(temperature=0.7, min_p=0.05, seed=4),
    dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.01, sampling_seed=5),
]


def _mixed_requests() -> list[Request]:
    return [
        req(f"m{i}", PROMPTS[i % len(PROMPTS)], max_new_tokens=6 + 3 * i, ignore_eos=True, **sp)
        for i, sp in enumerate(MIXED)
    ]


def test_results_do_not_depend_on_batch_mates():
    model = tiny_model()
    alone = {}
    for r in _mixed_requests():
        alone.update(run(make_engine(copy.deepcopy(model)), [r]))
    together = run(make_engine(copy.deepcopy(model)), _mixed_requests())
    staggered = run(make_engine(copy.deepcopy(model), max_running_requests=3), _mixed_requests(), stagger=2)
    for rid, a in alone.items():
        for b in (together[rid], staggered[rid]):
            assert b.output_ids == a.output_ids, rid
            torch.testing.assert_close(
                torch.tensor([lp for lp, _ in b.output_token_logprobs]),
                torch.tensor([lp for lp, _ in a.output_token_logprobs]),
                atol=1e-5,
                rtol=0,
            )


def test_seeds_reproduce_and_differ():
    model = tiny_model()
    e = make_engine(model)
    outs = run(
        e,
        [
            req(f"s{i}", "seeded", temperature=1.0, seed=s, max_new_tokens=16, ignore_eos=True)
            for i, s in enumerate([7, 7, 8])
        ],
    )
    assert outs["s0"].output_ids == outs["s1"].output_ids
    assert outs["s0"].output_ids != outs["s2"].output_ids
    # Unseeded requests draw seeds from the engine's random_seed: the same engine seed repeats them.
    a = run(
        make_engine(copy.deepcopy(model), random_seed=3),
        [req("u", "x", temperature=1.0, max_new_tokens=16, ignore_eos=True)],
    )
    b = run(
        make_engine(copy.deepcopy(model), random_seed=3),
        [req("u", "x", temperature=1.0, max_new_tokens=16, ignore_eos=True)],
    )
    assert a["u"].output_ids == b["u"].output_ids


def test_sampling_filters_degenerate_to_greedy():
    model = tiny_model()
    greedy = run(
        make_engine(copy.deepcopy(model)), [req("g", "abc", temperature=0.0, max_new_tokens=10, ignore_eos=True)]
    )["g"]
    for i, sp in enumerate([dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)]):
        out = run(
            make_engine(copy.deepcopy(model)),
            [req("x", "abc", temperature=1.5, seed=i, max_new_tokens=10, ignore_eos=True, **sp)],
        )["x"]
        assert out.output_ids == greedy.output_ids, sp
    # top_k=k: every sampled token is among the k most likely (top_logprobs lists them, raw distribution).
    out = run(
        make_engine(copy.deepcopy(model)),
        [
            Request(
                "k",
                TOK.encode("abc"),
                SamplingParams(temperature=2.0, top_k=3, seed=0, max_new_tokens=20, ignore_eos=True),
                return_logprob=True,
                top_logprobs_num=3,
            )
        ],
    )["k"]
    assert all(t in [i for _, i in top] for t, top in zip(out.output_ids, out.output_top_logprobs))


def test_logprobs_are_raw_unless_asked_for_temperature_scaled():
    model = tiny_model()
    raw = run(
        make_engine(copy.deepcopy(model)), [req("t", "abc", temperature=0.5, seed=1, max_new_tokens=5, ignore_eos=True)]
    )["t"]
    scaled = run(
        make_engine(copy.deepcopy(model), return_original_logprob=False),
        [req("t", "abc", temperature=0.5, seed=1, max_new_tokens=5, ignore_eos=True)],
    )["t"]
    assert raw.output_ids == scaled.output_ids
    ids = TOK.encode("abc") + raw.output_ids
    logits = model.eval()(torch.tensor([ids])).logits[0, len(TOK.encode("abc")) - 1 : -1].float()
    tgt = torch.tensor(raw.output_ids)[:, None]
    expect_raw = torch.log_softmax(logits, -1).gather(-1, tgt)[:, 0]
    expect_scaled = torch.log_softmax(logits / 0.5, -1).gather(-1, tgt)[:, 0]
    torch.testing.assert_close(torch.tensor([lp for lp, _ in raw.output_token_logprobs]), expect_raw, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.tensor([lp for lp, _ in scaled.output_token_logprobs]), expect_scaled, atol=1e-5, rtol=0
    )


def test_prompt_scoring():
    model = tiny_model()
    ref = copy.deepcopy(model).eval()
    ids = TOK.encode("score every token of this text")
    e = make_engine(model)
    outs = run(
        e,
        [
            Request(
                "all",
                ids,
                SamplingParams(max_new_tokens=0),
                return_logprob=True,
                top_logprobs_num=4,
                logprob_start_len=0,
            ),
            Request("from5", ids, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=5),
            Request("default", ids, SamplingParams(max_new_tokens=0), return_logprob=True),
        ],
    )
    expected = ref_logprobs(ref, ids)
    a = outs["all"]
    assert a.output_ids == [] and a.finish_reason == {"type": "length", "length": 0} and a.completion_tokens == 0
    assert [t for _, t in a.input_token_logprobs] == ids and a.input_token_logprobs[0][0] is None
    torch.testing.assert_close(torch.tensor([lp for lp, _ in a.input_token_logprobs[1:]]), expected, atol=1e-5, rtol=0)
    assert a.input_top_logprobs[0] is None and all(len(t) == 4 for t in a.input_top_logprobs[1:])
    full = torch.log_softmax(ref(torch.tensor([ids])).logits[0, :-1].float(), -1)
    top = full.topk(4, -1)
    torch.testing.assert_close(
        torch.tensor([[v for v, _ in t] for t in a.input_top_logprobs[1:]]), top.values, atol=1e-5, rtol=0
    )
    assert [[i for _, i in t] for t in a.input_top_logprobs[1:]] == top.indices.tolist()
    f = outs["from5"]  # SGLang: aligned with ids[5:], the first entry None
    assert [t for _, t in f.input_token_logprobs] == ids[5:] and f.input_token_logprobs[0][0] is None
    torch.testing.assert_close(
        torch.tensor([lp for lp, _ in f.input_token_logprobs[1:]]), expected[5:], atol=1e-5, rtol=0
    )
    assert outs["default"].input_token_logprobs == [(None, ids[-1])]


def test_stop_token_eos_string_and_min_new_tokens():
    model = tiny_model()
    base = run(
        make_engine(copy.deepcopy(model)), [req("b", "stop here", temperature=0.0, max_new_tokens=40, ignore_eos=True)]
    )["b"].output_ids
    k = 5
    tok = base[k]
    first = base.index(tok)
    out = run(
        make_engine(copy.deepcopy(model)),
        [req("t", "stop here", temperature=0.0, max_new_tokens=40, stop_token_ids=[tok])],
    )["t"]
    assert out.output_ids == base[: first + 1] and out.finish_reason == {"type": "stop", "matched": tok}
    assert out.text == TOK.decode(base[:first], skip_special_tokens=True)
    # eos: the tokenizer's eos id stops unless ignore_eos.
    e = make_engine(copy.deepcopy(model))
    e.eos_token_ids = {tok}
    out = run(e, [req("e", "stop here", temperature=0.0, max_new_tokens=40)])["e"]
    assert out.finish_reason == {"type": "stop", "matched": tok} and len(out.output_ids) == first + 1
    # SGLang's order: length before a stop token; ignore_eos turns stop_token_ids off too.
    out = run(
        make_engine(copy.deepcopy(model)),
        [req("l", "stop here", temperature=0.0, max_new_tokens=first + 1, stop_token_ids=[tok])],
    )["l"]
    assert out.finish_reason == {"type": "length", "length": first + 1}
    out = run(
        make_engine(copy.deepcopy(model)),
        [req("i", "stop here", temperature=0.0, max_new_tokens=40, stop_token_ids=[tok], ignore_eos=True)],
    )["i"]
    assert out.output_ids == base and out.finish_reason["type"] == "length"
    # min_new_tokens masks the stop token until that many tokens exist (greedy then takes another).
    out = run(
        make_engine(copy.deepcopy(model)),
        [req("m", "stop here", temperature=0.0, max_new_tokens=40, stop_token_ids=[tok], min_new_tokens=first + 1)],
    )["m"]
    assert len(out.output_ids) >= first + 1 and tok not in out.output_ids[: first + 1]
    # stop strings: the first printable ASCII character produced.
    j = next(i for i, t in enumerate(base) if 33 <= t < 127)
    stop = chr(base[j])
    first_j = next(i for i, t in enumerate(base) if t == base[j])
    out = run(
        make_engine(copy.deepcopy(model)),
        [req("s", "stop here", temperature=0.0, max_new_tokens=40, ignore_eos=True, stop=stop)],
    )["s"]
    assert out.finish_reason == {"type": "stop", "matched": stop} and out.output_ids == base[: first_j + 1]
    assert stop not in out.text
    kept = run(
        make_engine(copy.deepcopy(model)),
        [req("s", "stop here", temperature=0.0, max_new_tokens=40, ignore_eos=True, stop=[stop], no_stop_trim=True)],
    )["s"]
    assert kept.text.endswith(stop)


def test_streaming_outputs_every_step_and_context_clamp():
    e = make_engine(context_length=32)
    prompt = TOK.encode("x" * 20)
    e.add_request(
        Request("s", prompt, SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True), stream=True)
    )
    seen = []
    while e.has_work():
        seen += e.step()
    assert [len(o.output_ids) for o in seen] == list(range(1, 13))
    assert [o.finished for o in seen] == [False] * 11 + [True]
    assert seen[-1].finish_reason == {"type": "length", "length": 12}  # clamped to context_length - prompt
    assert all(o.text is not None for o in seen)


def test_abort_waiting_and_running():
    e = make_engine(max_running_requests=1)
    e.add_request(req("run", "a", temperature=0.0, max_new_tokens=50, ignore_eos=True))
    e.add_request(req("wait", "b", temperature=0.0, max_new_tokens=50, ignore_eos=True))
    e.add_request(req("other", "c", temperature=0.0, max_new_tokens=3, ignore_eos=True))
    e.step()
    e.step()
    e.abort("wait")
    e.abort("run")
    e.abort("no-such-rid")  # ignored
    finals = {}
    while e.has_work():
        for o in e.step():
            if o.finished:
                finals[o.rid] = o
    assert finals["run"].finish_reason["type"] == "abort" and finals["run"].completion_tokens == 2
    assert finals["wait"].finish_reason["type"] == "abort" and finals["wait"].output_ids == []
    assert finals["other"].finish_reason == {"type": "length", "length": 3}
    e.add_request(req("run", "a", max_new_tokens=1))  # a finished rid can be reused


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: req("x", "a", max_new_tokens=-1), "sampling_params.max_new_tokens"),
        (lambda: req("x", "a", top_p=0.0), "sampling_params.top_p"),
        (lambda: req("x", "a", top_k=0), "sampling_params.top_k"),
        (lambda: req("x", "a", temperature=-1.0), "sampling_params.temperature"),
        (lambda: req("x", "a", min_p=2.0), "sampling_params.min_p"),
        (lambda: req("x", "a", stop_token_ids=[10_000]), "sampling_params.stop_token_ids"),
        (lambda: req("x", "a", max_new_tokens="5"), "sampling_params.max_new_tokens"),
        (lambda: req("x", "a", min_new_tokens=5, max_new_tokens=2), "sampling_params.min_new_tokens"),
        (lambda: req("x", "a" * 300), "input_ids"),
        (lambda: Request("x", [], SamplingParams()), "input_ids"),
        (lambda: Request("x", [1, 999], SamplingParams()), "input_ids"),
        (lambda: Request("", [1], SamplingParams()), "rid"),
        (lambda: Request("x", [1, 2], SamplingParams(), return_logprob=True, logprob_start_len=2), "logprob_start_len"),
        (lambda: Request("x", [1, 2], SamplingParams(), top_logprobs_num=-1), "top_logprobs_num"),
    ],
)
def test_bad_requests_name_the_field(make, field):
    e = make_engine()
    with pytest.raises(ValueError, match=rf"^{field}:"):
        e.add_request(make())
    assert not e.has_work()


def test_sampling_params_from_dict():
    sp = SamplingParams.from_dict({"max_new_tokens": 4, "stop": "x", "temperature": 0, "top_k": None})
    assert sp.stop == ["x"] and sp.temperature == 0.0 and sp.top_k == -1
    with pytest.raises(ValueError, match=r"^sampling_params.frequency_penaltyy:"):
        SamplingParams.from_dict({"frequency_penaltyy": 1})
    with pytest.raises(ValueError, match=r"^sampling_params.ignore_eos:"):
        SamplingParams.from_dict({"ignore_eos": "yes"})
    e = make_engine()
    e.add_request(req("dup", "a"))
    with pytest.raises(ValueError, match=r"^rid:"):
        e.add_request(req("dup", "a"))


def test_load_weights_and_from_model_path(tmp_path):
    model = tiny_model(seed=0)
    target = copy.deepcopy(model).eval()
    e = make_engine(tiny_model(seed=1))
    names = e.load_weights((n, t.clone()) for n, t in model.state_dict().items())
    assert set(e.weight_names()) <= set(names)
    out = run(e, [req("w", "weights", temperature=0.0, max_new_tokens=6, ignore_eos=True)])["w"]
    ids = TOK.encode("weights") + out.output_ids
    torch.testing.assert_close(
        torch.tensor([lp for lp, _ in out.output_token_logprobs]),
        ref_logprobs(target, ids)[len(ids) - 7 :],
        atol=1e-5,
        rtol=0,
    )
    with pytest.raises(ValueError, match=r"^model.layers.0.mlp.nope.weight:"):
        e.load_weights([("model.layers.0.mlp.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"^lm_head.weight: shape"):
        e.load_weights([("lm_head.weight", torch.zeros(3, 3))])
    # our HF directory (config + safetensors + tokenizer) and the demo model
    model.save_pretrained(tmp_path / "ours")
    TOK.save(str(tmp_path / "ours"))
    loaded = EngineCore.from_model_path(str(tmp_path / "ours"), context_length=64)
    out2 = run(loaded, [req("w", "weights", temperature=0.0, max_new_tokens=6, ignore_eos=True)])["w"]
    assert out2.output_ids == out.output_ids
    demo = EngineCore.from_model_path(None, context_length=64)
    assert demo.config.hidden_size == 64 and demo.vocab_size == 384
    with pytest.raises(FileNotFoundError, match="model_path"):
        EngineCore.from_model_path(str(tmp_path / "missing"))


def test_dummy_load_format_needs_only_config_json(tmp_path):
    """SGLang's `--load-format dummy`: random weights from the seed, no weight file read."""
    tiny_model().config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        EngineCore.from_model_path(str(tmp_path))
    a, b, c = (
        EngineCore.from_model_path(str(tmp_path), load_format="dummy", random_seed=s, context_length=64)
        for s in (1, 1, 2)
    )
    wa, wb, wc = (e.model.lm_head.weight for e in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert run(a, [req("d", "dummy", temperature=0.0, max_new_tokens=3, ignore_eos=True)])["d"].completion_tokens == 3


def test_from_stock_qwen3_checkpoint(tmp_path):
    from transformers import Qwen3ForCausalLM

    from mcore_rl.hf import to_stock_hf_config

    cfg = to_stock_hf_config(tiny_model().config)
    torch.manual_seed(0)
    stock = Qwen3ForCausalLM(cfg).eval()
    stock.save_pretrained(tmp_path)
    e = EngineCore.from_model_path(str(tmp_path), context_length=64)  # no tokenizer there: the bundled one
    ids = TOK.encode("stock qwen3")
    out = run(e, [Request("q", ids, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)])["q"]
    with torch.no_grad():
        logits = stock(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor([lp for lp, _ in out.input_token_logprobs[1:]]), expected, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        dict(attention_bias=True, tie_word_embeddings=True, num_key_value_heads=1, head_dim=32),
    ],
    ids=["moe", "bias_tied_mqa"],
)
def test_other_architectures_match_reference(kw):
    model = tiny_model(**kw)
    if kw.get("attention_bias"):  # default init zeroes biases; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    ref = copy.deepcopy(model).eval()
    engine = make_engine(tiny_model(seed=9, **kw))  # other weights, then the model's loaded by name
    engine.load_weights(model.state_dict().items())
    outs = run(
        engine, [req(f"r{i}", p, temperature=0.0, max_new_tokens=5, ignore_eos=True) for i, p in enumerate(PROMPTS[:3])]
    )
    for i, p in enumerate(PROMPTS[:3]):
        ids = TOK.encode(p) + outs[f"r{i}"].output_ids
        torch.testing.assert_close(
            torch.tensor([lp for lp, _ in outs[f"r{i}"].output_token_logprobs]),
            ref_logprobs(ref, ids)[len(TOK.encode(p)) - 1 :],
            atol=1e-5,
            rtol=0,
        )


# ---- every architecture the trainer supports ---------------------------------------------------

ARCHS = {
    "attn_res_full": dict(attn_res="full"),
    # 4 sublayers in 3 blocks: sizes 1, 1, 2 (the last takes the remainder), so partial sums matter
    "attn_res_block": dict(attn_res="block", attn_res_num_blocks=3),
    "ngram": dict(ngram_orders=[2, 3], ngram_table_size=1009, ngram_num_slices=2),
    "no_qk_norm": dict(use_qk_norm=False),
    "latent_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_latent_size=32,
        shared_expert_intermediate_size=32,
    ),
}


def arch_model(seed: int = 0, **kw) -> McoreRLForCausalLM:
    """`tiny_model` with AttnRes pseudo-queries and key norms made non-trivial (they start at zero
    and one: uniform depth weights)."""
    model = tiny_model(seed, **kw)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attn_res." in name or "mlp_res." in name or "final_res." in name:
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + torch.randn(p.shape, generator=g) * 0.2)
    return model


def assert_serves_like_reference(make: Callable[[], EngineCore], ref, atol: float = 1e-5) -> None:
    """Greedy and sampled generation log-probs equal a full reference forward; a request's result
    does not depend on its batch mates (alone, all together, joining mid-batch with slots moving
    as others finish); prompt scoring equals the reference."""
    greedy = [req(f"g{i}", p, temperature=0.0, max_new_tokens=10, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    assert_matches_reference(ref, greedy, run(make(), copy.deepcopy(greedy)), atol)
    alone = {}
    for r in _mixed_requests():
        alone.update(run(make(), [r]))
    assert_matches_reference(ref, _mixed_requests(), alone, atol)
    together = run(make(), _mixed_requests())
    staggered = run(make(max_running_requests=3), _mixed_requests(), stagger=2)
    for rid, a in alone.items():
        for b in (together[rid], staggered[rid]):
            assert b.output_ids == a.output_ids, rid
            torch.testing.assert_close(lps(b.output_token_logprobs), lps(a.output_token_logprobs), atol=atol, rtol=0)
    ids = TOK.encode("score every token of this text, " * 2)
    scored = run(
        make(),
        [
            Request("all", ids, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0),
            Request(
                "from7",
                ids[:20],
                SamplingParams(max_new_tokens=3, ignore_eos=True),
                return_logprob=True,
                logprob_start_len=7,
            ),
        ],
    )
    expected = ref_logprobs(ref, ids)
    assert [t for _, t in scored["all"].input_token_logprobs] == ids
    torch.testing.assert_close(lps(scored["all"].input_token_logprobs[1:]), expected, atol=atol, rtol=0)
    torch.testing.assert_close(lps(scored["from7"].input_token_logprobs[1:]), expected[7:19], atol=atol, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_serves_like_the_reference(arch):
    kw = ARCHS[arch]
    model = arch_model(**kw)
    ref = copy.deepcopy(model).eval()
    state = model.state_dict()

    def make(**engine_kw) -> EngineCore:  # other weights, then the model's loaded by name
        e = make_engine(arch_model(seed=9, **kw), **engine_kw)
        e.load_weights((n, t.clone()) for n, t in state.items())
        return e

    assert_serves_like_reference(make, ref)


def test_all_new_architectures_at_once_from_model_path(tmp_path):
    """AttnRes Block + n-gram embeddings + LatentMoE + no QK-norm in one model, saved as our HF
    directory and served from it. The tolerance is looser than 1e-5: with every depth mix, n-gram
    table and latent expert stacked, fp32 rounding alone moves log-probs by more (measured: the
    fp32 reference is 1.8e-5 and the engine 1.6e-5 away from the same model run in fp64)."""
    kw = {**ARCHS["attn_res_block"], **ARCHS["ngram"], **ARCHS["latent_moe"], **ARCHS["no_qk_norm"]}
    model = arch_model(**kw)
    model.save_pretrained(tmp_path)
    ref = copy.deepcopy(model).eval()

    def make(**engine_kw) -> EngineCore:
        engine_kw.setdefault("context_length", 256)
        return EngineCore.from_model_path(str(tmp_path), **engine_kw)

    assert_serves_like_reference(make, ref, atol=4e-5)


def test_ngram_context_follows_the_slot():
    """The n-gram decode context is per slot: it is the last n-1 tokens of the prompt and output
    and moves with the request when another finishes."""
    model = arch_model(**ARCHS["ngram"])
    e = make_engine(copy.deepcopy(model), max_running_requests=2)
    e.add_request(req("short", "ab", temperature=0.0, max_new_tokens=2, ignore_eos=True))
    e.add_request(req("long", "a longer prompt", temperature=0.0, max_new_tokens=6, ignore_eos=True))
    e.step()  # prefill both
    assert e.runner.ngram_context[:2].tolist() == [TOK.encode("ab")[-2:], TOK.encode("a longer prompt")[-2:]]
    finals = {}
    while e.has_work():
        for o in e.step():
            finals[o.rid] = o
    long = finals["long"]
    assert e.runner.ngram_context[0].tolist() == (TOK.encode("a longer prompt") + long.output_ids)[-3:-1]
    assert_matches_reference(copy.deepcopy(model).eval(), [req("long", "a longer prompt")], finals)


@pytest.mark.parametrize("bias_tied", [False, True], ids=["plain", "bias_tied"])
def test_from_stock_llama_checkpoint(tmp_path, bias_tied):
    """A stock `LlamaForCausalLM` directory (random init, no QK-norm) is served like stock
    transformers computes it."""
    from transformers import LlamaForCausalLM

    from mcore_rl.hf import to_stock_hf_config

    kw = dict(attention_bias=True, tie_word_embeddings=True) if bias_tied else {}
    cfg = to_stock_hf_config(tiny_model(use_qk_norm=False, **kw).config)
    assert type(cfg).__name__ == "LlamaConfig"
    torch.manual_seed(0)
    stock = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    stock.save_pretrained(tmp_path)

    class StockRef:  # the reference interface of `ref_logprobs` over the stock model
        def __call__(self, ids):
            return stock(ids)

    def make(**engine_kw) -> EngineCore:
        engine_kw.setdefault("context_length", 256)
        return EngineCore.from_model_path(str(tmp_path), **engine_kw)

    e = make()
    assert e.config.use_qk_norm is False and e.config.attention_bias is bias_tied
    assert not hasattr(e.model.model.layers[0].self_attn.q_norm, "weight")
    assert_serves_like_reference(make, StockRef())


def test_stock_checkpoints_with_unsupported_fields_are_refused(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=384,
        mlp_bias=True,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"(?s)model_path: cannot serve this llama.*mlp_bias.*rope_type='dynamic'"):
        EngineCore.from_model_path(str(tmp_path))


def test_bf16_mode_runs_close_to_fp32():
    model = tiny_model()
    r = [req("b", "bf16 mode", temperature=0.0, max_new_tokens=8, ignore_eos=True)]
    fp32 = run(make_engine(copy.deepcopy(model)), copy.deepcopy(r))["b"]
    bf16_engine = make_engine(copy.deepcopy(model), dtype="bfloat16")
    assert next(bf16_engine.model.parameters()).dtype == torch.bfloat16
    ids = TOK.encode("bf16 mode") + fp32.output_ids
    scored = run(
        bf16_engine, [Request("s", ids, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)]
    )["s"]
    diff = torch.tensor([lp for lp, _ in scored.input_token_logprobs[1:]]) - ref_logprobs(model.eval(), ids)
    assert 0 < diff.abs().max() < 0.25


# ---- FP8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 384), (200, 70), (1, 129)])
def test_block_fp8_round_trip(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # channels of very different scales
    q, s = quantize_block_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    deq = dequantize_block_fp8(q, s)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normal values; below the normal range the
    # spacing is 2^-9 of the block scale (scale_inv maps the block's max to 448).
    scale = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    bound = w.abs() * 2**-4 + scale * 2**-9 * 0.5 + 1e-12
    assert ((deq - w).abs() <= bound).all()
    amax = w.abs().max()
    assert (deq - w).abs().max() <= amax * 2**-4
    q2, s2 = quantize_block_fp8(deq)  # idempotent on already-representable values
    torch.testing.assert_close(dequantize_block_fp8(q2, s2), deq, atol=0, rtol=0)
    zq, zs = quantize_block_fp8(torch.zeros(3, 5))
    assert (dequantize_block_fp8(zq, zs) == 0).all() and (zs == 1).all()


def test_activation_fp8_groups():
    x = torch.randn(3, 5, 300)
    y = quantize_activation_fp8(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert ((y - x).abs() <= x.abs() * 2**-4 + x.abs().amax() * 2**-9).all()
    assert not torch.equal(y, x)


def fp8_emulated_reference(model: McoreRLForCausalLM) -> McoreRLForCausalLM:
    """The reference model with what FP8 mode changes done by hand: quantized-dequantized weights
    and e4m3-rounded inputs for every decoder Linear except the MoE router."""
    emu = copy.deepcopy(model).eval()
    with torch.no_grad():
        for name, m in emu.named_modules():
            if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.") and not name.endswith("mlp.gate"):
                m.weight.copy_(dequantize_block_fp8(*quantize_block_fp8(m.weight)))
                m.register_forward_pre_hook(lambda _m, args: (quantize_activation_fp8(args[0]),))
    return emu


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        ARCHS["latent_moe"],
        ARCHS["attn_res_block"],
        ARCHS["ngram"],
        ARCHS["no_qk_norm"],
    ],
    ids=["dense", "moe", "latent_moe", "attn_res_block", "ngram", "no_qk_norm"],
)
def test_fp8_engine_equals_emulated_fp8_reference(kw):
    model = arch_model(**kw)
    e = make_engine(copy.deepcopy(model), quantization="fp8")
    if kw.get("num_experts"):
        assert isinstance(e.model.model.layers[0].mlp.gate, torch.nn.Linear)  # the router stays full precision
        assert isinstance(e.model.model.layers[0].mlp.experts[3].down_proj, Fp8Linear)
    if kw.get("moe_latent_size"):  # W_down / W_up are ordinary GEMMs: e4m3 like the experts (as SGLang)
        mlp = e.model.model.layers[0].mlp
        assert isinstance(mlp.fc1_latent_proj, Fp8Linear) and isinstance(mlp.fc2_latent_proj, Fp8Linear)
    ids = TOK.encode("fp8 against its emulation")
    out = run(e, [Request("s", ids, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)])["s"]
    got = torch.tensor([lp for lp, _ in out.input_token_logprobs[1:]])
    torch.testing.assert_close(got, ref_logprobs(fp8_emulated_reference(model), ids), atol=1e-5, rtol=0)


def test_fp8_engine_quantizes_and_differs_by_a_measured_amount():
    model = tiny_model()
    ids = TOK.encode("measure the fp8 mismatch on this sequence of tokens")
    score = [Request("s", ids, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)]
    e8 = make_engine(copy.deepcopy(model), quantization="fp8")
    layers = [m for m in e8.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 2 * 7  # q,k,v,o,gate,up,down per layer; lm_head stays full precision
    assert all(m.weight.dtype == FP8_DTYPE for m in layers)
    assert isinstance(e8.model.lm_head, torch.nn.Linear)
    fp8 = torch.tensor([lp for lp, _ in run(e8, copy.deepcopy(score))["s"].input_token_logprobs[1:]])
    fp32 = ref_logprobs(model.eval(), ids)
    d = fp32 - fp8
    k3 = (torch.exp(d) - d - 1).mean()
    assert 1e-6 < d.abs().mean() < 0.2 and k3 < 0.05
    # Pre-quantized weights (what an FP8 weight sync sends) give the very same engine.
    e8b = make_engine(tiny_model(seed=5), quantization="fp8")
    sd = model.state_dict()
    named = []
    for n, t in sd.items():
        if n.removesuffix(".weight") in e8b.fp8_layers:
            q, s = quantize_block_fp8(t)
            named += [(n, q), (n.removesuffix(".weight") + ".weight_scale_inv", s)]
        else:
            named.append((n, t))
    e8b.load_weights(named)
    fp8b = torch.tensor([lp for lp, _ in run(e8b, copy.deepcopy(score))["s"].input_token_logprobs[1:]])
    torch.testing.assert_close(fp8b, fp8, atol=0, rtol=0)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        make_engine(copy.deepcopy(model)).load_weights(
            [("model.layers.0.mlp.up_proj.weight_scale_inv", torch.ones(1, 1))]
        )


def test_slots_move_after_the_cache_grew():
    """A request finishing moves the last slot into its hole; that works after the cache grew
    inside a prefill (where new cache tensors are inference-mode tensors) too."""
    model = tiny_model()
    reqs = lambda: [
        req("a", "short", temperature=0.0, max_new_tokens=2, ignore_eos=True),
        req("b", "x" * 300, temperature=0.0, max_new_tokens=6, ignore_eos=True),
        req("c", "y" * 20, temperature=0.0, max_new_tokens=6, ignore_eos=True),
    ]
    e = make_engine(copy.deepcopy(model), context_length=400)
    together = run(e, reqs())
    assert e.runner.cache.capacity > 256
    for r in reqs():
        alone = run(make_engine(copy.deepcopy(model), context_length=400), [r])[r.rid]
        assert together[r.rid].output_ids == alone.output_ids
        torch.testing.assert_close(
            lps(together[r.rid].output_token_logprobs), lps(alone.output_token_logprobs), atol=1e-5, rtol=0
        )


def test_flush_cache_refuses_while_busy():
    e = make_engine()
    e.add_request(req("a", "a", max_new_tokens=3))
    assert e.flush_cache() is False
    while e.has_work():
        e.step()
    assert e.flush_cache() is True


# ---- partial rollouts: pausing across a weight update ----------------------------------------

PARTIAL = [
    ("p0", "partial rollouts", dict(temperature=0.0)),
    ("p1", "x", dict(temperature=1.0, sampling_seed=3)),
    ("p2", "a longer prompt than the others, to pad the batch", dict(temperature=0.0)),
]
BEFORE, TOTAL = 5, 14  # tokens generated before the pause, and in all


def _partial_requests() -> list[Request]:
    return [req(rid, p, max_new_tokens=TOTAL, ignore_eos=True, **sp) for rid, p, sp in PARTIAL]


def _paused_after_some_tokens(engine: EngineCore) -> list[Request]:
    """Start the PARTIAL requests and step until each has BEFORE tokens (none finishes)."""
    reqs = _partial_requests()
    for r in reqs:
        engine.add_request(r)
    for _ in range(BEFORE):  # the first step admits (one token), each later one decodes one
        assert not any(o.finished for o in engine.step())
    return reqs


@pytest.mark.parametrize("arch", ["plain", "ngram"])
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_requests_continue_on_kv_of_the_new_weights(mode, arch):
    """A partial rollout: requests stop after BEFORE tokens, the weights change, they go on. Each
    token's log-prob is what a cache-free forward of the whole final sequence gives under the
    weights its version names, so no token after the update read K/V of the old weights
    ("in_place" recomputed them in the slot, "retract" prefilled prompt + tokens so far again).
    Checked once by hand that this can fail: with `EngineCore._recompute_stale` a no-op (the stale-KV
    path) every post-update log-prob of the in_place case is off, by up to 7.3 nats (plain) and 8.0
    (ngram)."""
    kw = ARCHS.get(arch, {})
    model = arch_model(**kw)
    old = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(1)
    new_state = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in old.state_dict().items()}
    new = copy.deepcopy(old)
    new.load_state_dict(new_state)
    engine = make_engine(model)
    reqs = _paused_after_some_tokens(engine)
    if mode == "retract":
        assert engine.retract() == len(reqs)
        assert engine.num_running_reqs == 0 and engine.num_waiting_reqs == len(reqs) and engine.num_cached_tokens == 0
    engine.load_weights(new_state.items())
    engine.weight_version = "v1"
    finals = run(engine, [])
    for r in reqs:
        o = finals[r.rid]
        assert o.output_token_weight_versions == [0] * BEFORE + ["v1"] * (TOTAL - BEFORE)
        assert o.weight_version == "v1" and len(o.input_token_logprobs) == 1  # scored once, at admission
        full, n = r.input_ids + o.output_ids, len(r.input_ids)
        got = lps(o.output_token_logprobs)
        torch.testing.assert_close(got[:BEFORE], ref_logprobs(old, full)[n - 1 :][:BEFORE], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[BEFORE:], ref_logprobs(new, full)[n - 1 :][BEFORE:], atol=1e-5, rtol=0)
    # in_place recomputes prompt + output[:-1] (the last token is the next decode input); retract all of it
    assert engine.recomputed_tokens == sum(len(r.input_ids) + BEFORE - (mode == "in_place") for r in reqs)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_pause_without_a_weight_update_changes_nothing(mode):
    """No weight load between pause and continue: in_place recomputes nothing and gives the
    uninterrupted result exactly; retract re-prefills and gives the same tokens (the request's
    random stream carries on) with log-probs equal to float rounding. A retracted request can be
    aborted and returns its partial output."""
    model = tiny_model()
    straight = run(make_engine(copy.deepcopy(model)), _partial_requests())
    engine = make_engine(model)
    reqs = _paused_after_some_tokens(engine)
    if mode == "retract":
        engine.retract()
        engine.abort("p1")
        aborted = [o for o in engine.step() if o.rid == "p1"][0]
        assert aborted.finish_reason["type"] == "abort" and aborted.output_ids == straight["p1"].output_ids[:BEFORE]
        assert aborted.output_token_weight_versions == [0] * BEFORE and len(aborted.output_token_logprobs) == BEFORE
    finals = run(engine, [])
    for r in reqs:
        if r.rid not in finals:
            continue
        a, b = straight[r.rid], finals[r.rid]
        assert b.output_ids == a.output_ids and b.output_token_weight_versions == [0] * TOTAL
        if mode == "in_place":
            assert lps(b.output_token_logprobs).tolist() == lps(a.output_token_logprobs).tolist()
        torch.testing.assert_close(lps(b.output_token_logprobs), lps(a.output_token_logprobs), atol=1e-5, rtol=0)
    resumed = sum(len(r.input_ids) + BEFORE for r in reqs if r.rid != "p1")
    assert engine.recomputed_tokens == (0 if mode == "in_place" else resumed)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_fp8_paused_requests_use_the_new_quantized_weights(mode):
    """FP8 keeps fused dequantized copies derived from the weights (`ModelRunner.refresh`): after
    a load while paused, the tokens that follow have the log-probs a fresh FP8 engine holding only
    the new weights gives the final sequence (prompt scoring, teacher-forced)."""
    model = tiny_model(hidden_size=128, intermediate_size=256)  # 128-wide blocks: every Linear in FP8
    old = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    new_state = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in old.state_dict().items()}
    engine = make_engine(model, quantization="fp8")
    reqs = _paused_after_some_tokens(engine)
    if mode == "retract":
        engine.retract()
    engine.load_weights(new_state.items())
    finals = run(engine, [])
    scorer = make_engine(old, quantization="fp8")
    scorer.load_weights(new_state.items())
    for r in reqs:
        o, n = finals[r.rid], len(r.input_ids)
        full = Request(
            "s",
            r.input_ids + o.output_ids,
            SamplingParams(max_new_tokens=0),
            return_logprob=True,
            logprob_start_len=n - 1,
        )
        scored = run(scorer, [full])["s"]
        torch.testing.assert_close(
            lps(o.output_token_logprobs)[BEFORE:], lps(scored.input_token_logprobs[1:])[BEFORE:], atol=1e-5, rtol=0
        )


# --- SGLang's logit processors, stop_regex, the default context, the source's model type ----------


def sglang_processed(logits: torch.Tensor, out_so_far: list[int], sp: SamplingParams) -> torch.Tensor:
    """SGLang's penalizers and logit_bias written out for one row, from their definitions (not
    through `penalize`): repetition scales a generated token's logit (/ if > 0, x if < 0), then
    frequency subtracts penalty x count and presence subtracts penalty once; logit_bias adds."""
    z = logits.clone()
    for t in set(out_so_far):
        z[t] = z[t] / sp.repetition_penalty if z[t] > 0 else z[t] * sp.repetition_penalty
        z[t] -= sp.frequency_penalty * out_so_far.count(t) + sp.presence_penalty
    for k, v in (sp.logit_bias or {}).items():
        z[int(k)] += v
    return z


PENALIZED = dict(
    temperature=0.8,
    top_k=6,
    frequency_penalty=0.7,
    presence_penalty=0.4,
    repetition_penalty=1.6,
    logit_bias={"65": 1.5, "66": -2.0},
    max_new_tokens=24,
    ignore_eos=True,
    seed=5,
)


def test_penalties_and_logit_bias_shape_the_processed_distribution():
    """The processed log-prob of every sampled token (μ in --logprobs-mode processed) is that of
    SGLang's penalized, biased, temperature-scaled, top-k-truncated distribution, recomputed here
    from one full forward of the reference model; the raw log-probs stay the model's."""
    model = tiny_model()
    ref = copy.deepcopy(model).eval()
    prompt = TOK.encode("aaaa bbbb")
    sp = SamplingParams(**PENALIZED)
    out = run(make_engine(model, logprobs_mode="processed"), [Request("p", prompt, sp, return_logprob=True)])["p"]
    raw = run(
        make_engine(copy.deepcopy(ref)), [Request("p", prompt, SamplingParams(**PENALIZED), return_logprob=True)]
    )["p"]
    assert raw.output_ids == out.output_ids and len(out.output_ids) == 24
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out.output_ids])).logits[0].float()
    n = len(prompt)
    for t, tok in enumerate(out.output_ids):
        z = sglang_processed(logits[n - 1 + t], out.output_ids[:t], sp) / sp.temperature
        kept = z.topk(sp.top_k).indices
        assert tok in kept.tolist(), t
        want = torch.log_softmax(z[kept], -1)[kept.tolist().index(tok)]
        assert abs(out.output_token_logprobs[t][0] - want.item()) < 1e-5, t
        assert abs(raw.output_token_logprobs[t][0] - torch.log_softmax(logits[n - 1 + t], -1)[tok].item()) < 1e-5
    repeated = len(out.output_ids) - len(set(out.output_ids))
    plain = run(
        make_engine(copy.deepcopy(ref)),
        [
            req(
                "q",
                prompt,
                **{
                    **PENALIZED,
                    "frequency_penalty": 0.0,
                    "presence_penalty": 0.0,
                    "repetition_penalty": 1.0,
                    "logit_bias": None,
                },
            )
        ],
    )["q"]
    assert repeated < len(plain.output_ids) - len(set(plain.output_ids))  # the penalties do what they are for


def test_logit_bias_forces_and_forbids_tokens_without_touching_batch_mates():
    """SGLang's test_logit_bias / test_forbidden_token / test_logit_bias_isolation on the engine."""
    model = tiny_model()
    prompt = TOK.encode("the capital of France is")
    forced = req("forced", prompt, temperature=1.0, max_new_tokens=6, logit_bias={"80": 100.0}, seed=1)
    greedy = run(
        make_engine(copy.deepcopy(model)), [req("g", prompt, temperature=0, max_new_tokens=8, ignore_eos=True)]
    )["g"]
    banned_id = greedy.output_ids[0]
    banned = req(
        "banned", prompt, temperature=0, max_new_tokens=8, ignore_eos=True, logit_bias={str(banned_id): -100.0}
    )
    alone = run(make_engine(copy.deepcopy(model)), [req("plain", prompt, temperature=1.0, max_new_tokens=6, seed=2)])
    outs = run(
        make_engine(copy.deepcopy(model)),
        [forced, banned, req("plain", prompt, temperature=1.0, max_new_tokens=6, seed=2)],
    )
    assert outs["forced"].output_ids == [80] * 6
    assert banned_id not in outs["banned"].output_ids and outs["banned"].output_ids != greedy.output_ids
    assert outs["plain"].output_ids == alone["plain"].output_ids
    torch.testing.assert_close(
        lps(outs["plain"].output_token_logprobs), lps(alone["plain"].output_token_logprobs), rtol=0, atol=1e-5
    )  # batch mates change fp32 logits by rounding only


def test_penalties_are_refused_out_of_sglang_ranges_and_next_to_a_sampling_mask():
    e = make_engine()
    for bad, field in [
        (dict(frequency_penalty=2.5), "frequency_penalty must be in \\[-2, 2\\]"),
        (dict(presence_penalty=-3.0), "presence_penalty must be in \\[-2, 2\\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be in \\(0, 2\\]"),
        (dict(logit_bias={"384": 1.0}), "logit_bias must has keys in \\[0, 383\\]"),
        (dict(logit_bias={"x": 1.0}), "logit_bias: keys must be token ids"),
        (dict(stop_regex="(unclosed"), "stop_regex: '\\(unclosed' is not a valid regular expression"),
    ]:
        with pytest.raises(ValueError, match=field):
            e.add_request(req("x", "a", **bad))
    masked = Request("m", TOK.encode("a"), SamplingParams(top_k=5, repetition_penalty=1.2), return_sampling_mask=True)
    with pytest.raises(
        ValueError, match="return_sampling_mask: cannot be combined with sampling_params.repetition_penalty"
    ):
        e.add_request(masked)
    assert not e.has_work()


def test_stop_regex_ends_the_request_as_sglang_does():
    from mcore_rl.rollout.engine.sampling import MAX_REGEX_TAIL, regex_tail_tokens

    assert regex_tail_tokens(["and|or"]) == 4 and regex_tail_tokens(["ab{2,3}"]) == 5
    assert regex_tail_tokens([r"[.!?]\s*$"]) == MAX_REGEX_TAIL + 1
    model = tiny_model()
    prompt = TOK.encode("hello")
    free = run(
        make_engine(copy.deepcopy(model)), [req("f", prompt, temperature=0, max_new_tokens=30, ignore_eos=True)]
    )["f"]
    # a letter the output produces a few tokens in; the request must stop at the first output
    # whose decoded tail (SGLang's: the last regex_tail_tokens tokens, special tokens skipped) matches
    target = next(
        c
        for k in range(3, 30)
        for c in [TOK.decode(free.output_ids[k : k + 1])]
        if c.isascii() and c.isalnum() and c not in TOK.decode(free.output_ids[:k], skip_special_tokens=True)
    )
    for pat in (re.escape(target), f"(?:{re.escape(target)})+"):  # a bounded and an unbounded pattern
        window = regex_tail_tokens([pat])
        stop_at = next(
            k
            for k in range(1, 31)
            if re.search(pat, TOK.decode(free.output_ids[max(0, k - window) : k], skip_special_tokens=True))
        )
        assert stop_at >= 3
        out = run(
            make_engine(copy.deepcopy(model)),
            [req("r", prompt, temperature=0, max_new_tokens=30, ignore_eos=True, stop_regex=[r"(?!)", pat])],
        )["r"]
        assert out.finish_reason == {"type": "stop", "matched": pat}
        assert out.output_ids == free.output_ids[:stop_at]


def test_context_length_defaults_to_the_models_and_the_source_model_type_is_kept(tmp_path):
    """SGLang's default context is the model's max_position_embeddings (not 2,048); /model_info's
    model_type and architectures are those of the checkpoint (a stock Llama: llama)."""
    from transformers import LlamaForCausalLM

    from mcore_rl.hf import to_stock_hf_config

    assert EngineCore(tiny_model(max_position_embeddings=4096), TOK).context_length == 4096
    assert EngineCore(tiny_model(max_position_embeddings=96), TOK).context_length == 96
    cfg = to_stock_hf_config(tiny_model(use_qk_norm=False, max_position_embeddings=3000).config)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    e = EngineCore.from_model_path(str(tmp_path))
    assert e.context_length == 3000
    assert (e.hf_model_type, e.hf_architectures) == ("llama", ["LlamaForCausalLM"])
    demo = EngineCore.from_model_path(None)
    assert demo.context_length == 2048 and demo.hf_model_type == "mcore_rl"


# --- the bounded KV pool ------------------------------------------------------------------------


def test_kv_pool_memory_is_bounded_whatever_the_prompt_lengths():
    """The pool is sized once, in tokens: a long prompt among short ones changes neither its size
    nor anyone's tokens (the slot cache gave every slot the longest sequence's capacity)."""
    model = tiny_model(max_position_embeddings=1024)
    e = make_engine(copy.deepcopy(model), context_length=1024, max_total_tokens=1024)
    cache = e.runner.cache
    size = cache.nbytes
    assert e.max_total_num_tokens == cache.capacity == 1024
    assert size == (1024 + cache.page_size) * e.runner.kv_bytes_per_token  # + the null page
    reqs = lambda: (
        [req("long", [7] * 700, temperature=0.0, max_new_tokens=8, ignore_eos=True)]
        + [req(f"s{i}", f"short {i}", temperature=0.0, max_new_tokens=8, ignore_eos=True) for i in range(12)]
    )
    peak = 0
    outs: dict[str, RequestOutput] = {}
    for r in reqs():
        e.add_request(r)
    while e.has_work():
        outs.update({o.rid: o for o in e.step() if o.finished})
        peak = max(peak, cache.used_tokens)
    assert cache.nbytes == size and 700 < peak <= 1024 and cache.used_tokens == 0
    for r in reqs():
        alone = run(make_engine(copy.deepcopy(model), context_length=1024), [r])[r.rid]
        assert outs[r.rid].output_ids == alone.output_ids
        torch.testing.assert_close(
            lps(outs[r.rid].output_token_logprobs), lps(alone.output_token_logprobs), atol=1e-5, rtol=0
        )


def test_a_request_that_cannot_fit_the_pool_is_refused_and_max_new_tokens_clamped():
    e = make_engine(context_length=256, max_total_tokens=64)
    assert e.max_req_len == 64
    with pytest.raises(ValueError, match=r"input_ids: 64 tokens cannot fit the KV cache, which holds 64 tokens"):
        e.add_request(req("big", [3] * 64))
    out = run(e, [req("fits", [3] * 50, temperature=0.0, max_new_tokens=100, ignore_eos=True)])["fits"]
    assert out.finish_reason == {"type": "length", "length": 14}  # SGLang clamps to what the pool holds
    with pytest.raises(ValueError, match="max_total_tokens: must be an integer >= 16"):
        make_engine(max_total_tokens=8)
    with pytest.raises(ValueError, match=r"mem_fraction_static: must be a number in \(0, 1\)"):
        make_engine(mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="mem_fraction_static: 1e-12 of .* not one page"):
        make_engine(mem_fraction_static=1e-12)


def test_decode_out_of_pages_retracts_the_newest_and_every_request_finishes():
    """Requests admitted together outgrow the pool while decoding: the newest are retracted (their
    pages freed, prefilled again later) and all finish with the tokens they get alone."""
    model = tiny_model()
    reqs = lambda: [
        req(f"r{i}", f"prompt number {i} " * 2, temperature=0.0, max_new_tokens=60, ignore_eos=True) for i in range(4)
    ]
    e = make_engine(copy.deepcopy(model), max_total_tokens=160)
    outs = run(e, reqs())
    assert e.retracted_for_room > 0 and e.recomputed_tokens > 0 and e.runner.cache.used_tokens == 0
    for r in reqs():
        alone = run(make_engine(copy.deepcopy(model)), [r])[r.rid]
        assert outs[r.rid].output_ids == alone.output_ids
        torch.testing.assert_close(
            lps(outs[r.rid].output_token_logprobs), lps(alone.output_token_logprobs), atol=1e-5, rtol=0
        )


def test_kv_pool_pages_move_grow_and_come_back():
    """Pages: handed out lowest first, moved with their slot (no K/V copied), kept across the
    pool's doubling, returned on free and on release."""
    from mcore_rl.rollout.engine.kv_cache import INITIAL_PAGES, PagedKVCache

    cache = PagedKVCache(2, 4, 2, 8, 16 * 4 * INITIAL_PAGES, 10_000, torch.float32, torch.device("cpu"))
    assert cache.k.shape[2] == (INITIAL_PAGES + 1) * 16
    assert cache.reserve(0, 40) and cache._slot_pages[0] == [1, 2, 3]
    rows = cache.prefill_rows(0, [40], 40)
    k = torch.randn(1, 2, 40, 8)
    cache.write_prefill(1, rows, k, -k)
    assert cache.reserve(1, 16 * (INITIAL_PAGES + 5))  # beyond the first allocation: the pool doubles
    assert cache.k.shape[2] == (2 * INITIAL_PAGES + 1) * 16
    cache.move(0, 2)
    write, read = cache.decode_rows(torch.tensor([5, 5, 39]), 40)
    keys, vals = cache.gather(1, read)  # [KV * B, T, D]
    assert torch.equal(keys.view(2, 3, 40, 8)[:, 2], k[0]) and torch.equal(vals.view(2, 3, 40, 8)[:, 2], -k[0])
    assert torch.count_nonzero(keys.view(2, 3, 40, 8)[:, 0]) == 0  # slot 0 holds nothing now: the null page
    assert not cache.reserve(3, 16 * 4 * INITIAL_PAGES)  # too few free pages: nothing taken
    free = cache.free_pages
    cache.free(2)
    assert cache.free_pages == free + 3 and cache.reserve(3, 16) and cache._slot_pages[3] == [1]
    cache.free(1)
    cache.free(3)
    cache.release()
    assert cache.nbytes == 0 and cache.free_pages == cache.num_pages
    cache.allocate()
    assert cache.k.shape[2] == (INITIAL_PAGES + 1) * 16 and cache.reserve(0, 16) and cache._slot_pages[0] == [1]
