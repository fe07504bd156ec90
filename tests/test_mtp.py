"""MTP draft heads: Bebop's losses (algos/mtp_draft.py), the reference heads (hf/mtp.py) and
megatron-core's (models/mtp.py) computing the same logits, and their training step (train/mtp_loss.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from mcore_rl.algos.mtp_draft import (
    acceptance,
    e2e_tv_loss,
    expected_accepted_length,
    mtp_draft_loss,
    tv_distance,
)
from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf import McoreRLForCausalLM
from tests.world import run_world

V = 48
MTP = ModelConfig.of(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=V,
    make_vocab_size_divisible_by=32,  # padded to 64: the heads' logits are masked as the policy's
    mtp_num_layers=2,
)


def _dists(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 7, generator=g, dtype=torch.float64) * 2).softmax(-1), (
        torch.randn(n, 7, generator=g, dtype=torch.float64) * 2
    ).softmax(-1)


def test_acceptance_is_one_minus_tv_and_rejection_sampling_rate() -> None:
    p, q = _dists(5, 0)
    half_l1 = 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(tv_distance(p, q), half_l1)
    # Σ_y q(y) min(1, p(y)/q(y)): the chance rejection sampling accepts a draft from q
    torch.testing.assert_close(acceptance(p, q), (q * (p / q).clamp(max=1)).sum(-1))


def test_tv_gradient_matches_the_closed_form_bounded_and_stops_at_p() -> None:
    g = torch.Generator().manual_seed(1)
    z_p = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    z_q = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    loss, _ = mtp_draft_loss([z_p], [z_q], "tv")
    loss.sum().backward()
    assert z_q.grad is not None
    p, q = z_p.detach().softmax(-1), z_q.detach().softmax(-1)
    below = (q <= p).double()
    s = (below * q).sum(-1, keepdim=True)
    torch.testing.assert_close(z_q.grad, -q * (below - s))  # Bebop's ∂L_TV/∂z_j = −q_j(1[q_j ≤ p_j] − S)
    assert float(z_q.grad.abs().max()) <= 1.0
    assert z_p.grad is None or float(z_p.grad.abs().max()) == 0.0  # p is the detached target
    # finite differences away from ties
    eps = 1e-6
    zq = z_q.detach().clone()
    for j in range(3):
        bumped = zq.clone()
        bumped[0, j] += eps
        numeric = (tv_distance(p[:1], bumped[:1].softmax(-1)) - tv_distance(p[:1], zq[:1].softmax(-1))) / eps
        assert abs(float(numeric) - float(z_q.grad[0, j])) < 1e-5


def test_e2e_loss_properties() -> None:
    p, q = _dists(6, 2)
    a = acceptance(p, q)
    torch.testing.assert_close(e2e_tv_loss(a[None]), tv_distance(p, q))  # γ = 1: d_TV
    assert float(e2e_tv_loss(torch.ones(3, 4, dtype=torch.float64)).abs().max()) == 0.0  # q = p everywhere
    alphas = torch.tensor([[0.9], [0.5], [0.8]], dtype=torch.float64)
    assert float(expected_accepted_length(alphas)) == pytest.approx(0.9 + 0.45 + 0.36)
    # equal α: earlier depths weigh more, ∂L/∂d_j = (1/γ) Σ_{l ≥ j} a^{l-1}
    d = torch.full((3, 1), 0.3, dtype=torch.float64, requires_grad=True)
    e2e_tv_loss(1 - d).sum().backward()
    assert d.grad is not None
    a_ = 0.7
    torch.testing.assert_close(d.grad[:, 0], torch.tensor([1 + a_ + a_**2, a_ + a_**2, a_**2], dtype=torch.float64) / 3)


def test_ce_gradient_is_q_minus_p() -> None:
    g = torch.Generator().manual_seed(3)
    z_p = torch.randn(3, 8, generator=g, dtype=torch.float64)
    z_q = torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    loss, alphas = mtp_draft_loss([z_p], [z_q], "ce")
    loss.sum().backward()
    assert z_q.grad is not None
    torch.testing.assert_close(z_q.grad, z_q.detach().softmax(-1) - z_p.softmax(-1))
    assert alphas.shape == (1, 3)
    with pytest.raises(ValueError, match="kind 'kl'"):
        mtp_draft_loss([z_p], [z_q], "kl")  # type: ignore[arg-type]  # a wrong kind on purpose


def _reference(seed: int = 0) -> McoreRLForCausalLM:
    from mcore_rl.hf import hf_config_from_model_config
    from tests.helpers import _randomize

    torch.manual_seed(seed)
    model = McoreRLForCausalLM(hf_config_from_model_config(MTP)).float()
    with torch.no_grad():
        _randomize(model)
    return model


def test_reference_heads_names_and_round_trip() -> None:
    from mcore_rl.config.model_keys.mtp import MTPKeys
    from mcore_rl.hf import hf_config_from_model_config, model_config_from_hf_config

    hf = hf_config_from_model_config(MTP)
    assert hf.mtp_num_layers == 2
    assert model_config_from_hf_config(hf).section(MTPKeys).mtp_num_layers == 2
    names = set(_reference().state_dict())
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.q_proj", "mlp.down_proj"):
        assert f"mtp.layers.1.{part}.weight" in names
    assert not any(n.startswith("model.layers.2.") for n in names)  # the heads are not decoder layers


def test_bad_mtp_settings_fail_naming_the_key() -> None:
    from mcore_rl.config import ConfigError, validate_sft_config
    from mcore_rl.config.schema import SFTConfig

    with pytest.raises(ConfigError, match="model.mtp_num_layers"):
        validate_sft_config(SFTConfig(model=MTP.replace(mtp_num_layers=-1)), world_size=1)
    with pytest.raises(ConfigError, match="model.mtp_num_layers"):
        validate_sft_config(SFTConfig(model=MTP.replace(attn_res="full")), world_size=1)


def _world(rank: int, world_size: int, ref_state: dict, ref_main: torch.Tensor, ref_depths: list, batch: dict) -> None:
    from mcore_rl.config.schema import ParallelConfig, TrainConfig
    from mcore_rl.hf.weight_map import full_megatron_to_hf, hf_to_megatron
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.models.mtp import mtp_logits
    from mcore_rl.models.shards import gather_full_state_dict, load_full_state_dict
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.forward_backward import forward_backward, prepare_config, wrap_ddp
    from mcore_rl.train.logprobs import make_forward_step
    from mcore_rl.train.mtp_loss import MTPForwardStep

    pc = ParallelConfig()
    init_model_parallel(pc)
    set_seed(1)
    config = transformer_config(MTP, pc)
    chunks = build_model(MTP, pc, config=config)
    load_full_state_dict(chunks, hf_to_megatron(ref_state, MTP))
    # the heads' weights by HF name, both ways (what the exporter and the weight sync send)
    back = full_megatron_to_hf(gather_full_state_dict(chunks), MTP)
    assert set(back) == set(ref_state), sorted(set(back) ^ set(ref_state))
    for k, v in back.items():
        torch.testing.assert_close(v, ref_state[k], msg=k)

    gpt = chunks[0]
    with torch.no_grad():
        gpt.eval()
        gpt(batch["tokens"], batch["position_ids"], None)
        policy, heads = mtp_logits(gpt, batch["tokens"], batch["position_ids"])
        main = policy.transpose(0, 1)[..., :V]
        depths = [x.transpose(0, 1)[..., :V] for x in heads]
    torch.testing.assert_close(main, ref_main, rtol=1e-4, atol=1e-4)
    for d, (got, want) in enumerate(zip(depths, ref_depths)):
        s = got.shape[1] - d - 1  # the last d + 1 rows read tokens past the end
        torch.testing.assert_close(got[:, :s], want[:, :s], rtol=1e-4, atol=1e-4, msg=lambda m: f"depth {d + 1}: {m}")

    # training: the heads get a gradient; the policy's gradient is the one without heads
    ddp = wrap_ddp(chunks, config)
    prepare_config(config, ddp)
    for kind in ("tv", "ce"):
        step = MTPForwardStep(kind, 1.0)
        forward_backward(ddp, [batch], forward_step=step)
        grads = {n: p.main_grad.clone() for n, p in ddp[0].module.named_parameters()}
        assert step.rows > 0 and 0 < step.metrics()["mtp_accept_len"] <= 2
        assert any(float(g.abs().max()) > 0 for n, g in grads.items() if n.startswith("mtp.")), kind
        forward_backward(ddp, [batch])  # the policy's loss alone (the heads are not run)
        for n, p in ddp[0].module.named_parameters():
            if not n.startswith("mtp."):
                torch.testing.assert_close(grads[n], p.main_grad, msg=lambda m: f"{kind} {n}: {m}")
    assert TrainConfig().mtp_loss == "tv"

    # the RL learner's step (its forward stops at the decoder's output; chunked log-probs): the same
    def logprob_loss(b: dict, stats: Any) -> tuple:
        mask = b["loss_mask"].float()
        loss = -(stats.logprobs * mask).sum()
        return loss, mask.sum().to(torch.int), {"lm_loss": torch.stack([loss.detach(), mask.sum()])}

    rl_step = make_forward_step(logprob_loss, with_entropy=False)
    heads_step = MTPForwardStep("tv", 1.0, base=rl_step)
    forward_backward(ddp, [batch], forward_step=heads_step)
    grads = {n: p.main_grad.clone() for n, p in ddp[0].module.named_parameters()}
    assert heads_step.rows > 0
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if n.startswith("mtp."))
    forward_backward(ddp, [batch], forward_step=rl_step)
    for n, p in ddp[0].module.named_parameters():
        if not n.startswith("mtp."):
            torch.testing.assert_close(grads[n], p.main_grad, msg=lambda m: f"rl {n}: {m}")


def test_megatron_heads_match_the_reference_and_train_beside_the_policy() -> None:
    ref = _reference()
    g = torch.Generator().manual_seed(5)
    s = 12
    tokens = torch.randint(0, V, (2, s + 1), generator=g)
    batch = dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        loss_mask=torch.ones(2, s),
        position_ids=torch.arange(s).expand(2, s).contiguous(),
    )
    with torch.no_grad():
        main, depths = ref.mtp_logits(batch["tokens"])
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    run_world(1, _world, state, main, depths, batch)


# ---- the MTP drafter in the embedded engine (rollout/engine/drafts.py: MTPDrafter) ----------------


def _mtp_model(seed: int = 0, **kw: Any) -> McoreRLForCausalLM:
    from tests.helpers import tiny_model

    return tiny_model(seed, mtp_num_layers=2, **kw)


def test_mtp_drafter_samples_the_exact_joint_distribution() -> None:
    """2,000 seeded requests of four tokens (three per verification): the joint equals plain
    sampling's, computed exactly from the reference model; drafts are made, some accepted."""
    from mcore_rl.rollout.engine.core import Request
    from mcore_rl.rollout.engine.sampling import SamplingParams
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings
    from tests.helpers import make_engine, run
    from tests.test_speculative import JOINT_PROMPT, JOINT_SP, JOINT_TOKENS, JOINT_VOCAB, chi_square_pvalue, exact_joint

    model = _mtp_model(vocab_size=JOINT_VOCAB)
    joint = exact_joint(model, JOINT_PROMPT, SamplingParams(**JOINT_SP), JOINT_TOKENS)
    engine = make_engine(copy.deepcopy(model), max_running_requests=64, speculative=SpeculativeSettings("NEXTN", 3))
    n = 2000
    outs = run(engine, [Request(f"r{i}", JOINT_PROMPT, SamplingParams(**JOINT_SP, seed=i)) for i in range(n)])
    stats = engine.spec_stats
    assert stats["drafted"] > n and 0 < stats["accepted"] < stats["drafted"]
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1)
    for o in outs.values():
        counts[index.get(tuple(o.output_ids), len(cells))] += 1
    assert chi_square_pvalue(counts, torch.tensor([joint[c] for c in cells] + [0.0])) > 1e-3


def test_mtp_drafter_greedy_is_plain_decoding_and_k_beyond_the_depths() -> None:
    """Temperature 0, requests joining every other step, 5 drafted tokens from 2 depths (the last
    depth reused): plain decoding's tokens and log-probs."""
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings
    from tests.helpers import make_engine, run
    from tests.test_speculative import _greedy_requests

    plain = run(make_engine(_mtp_model()), _greedy_requests())
    engine = make_engine(_mtp_model(), speculative=SpeculativeSettings("NEXTN", 5))
    outs = run(engine, _greedy_requests(), stagger=2)
    assert engine.spec_stats["drafted"] > 0
    for rid, want in plain.items():
        assert outs[rid].output_ids == want.output_ids and outs[rid].finish_reason == want.finish_reason
        for (a, _), (b, _) in zip(outs[rid].output_token_logprobs, want.output_token_logprobs):
            assert a == pytest.approx(b, abs=1e-5)


def test_a_weight_load_updates_the_mtp_heads() -> None:
    """New head weights loaded by HF name into a running engine (what the weight sync sends) draft
    exactly as an engine built with them: same tokens of seeded sampled requests and same drafting
    counts; the old heads give other ones."""
    from mcore_rl.rollout.engine.core import Request
    from mcore_rl.rollout.engine.sampling import SamplingParams
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings
    from tests.helpers import TOK, make_engine, run

    spec = SpeculativeSettings("NEXTN", 3)
    new_heads = {n: t for n, t in _mtp_model(9).state_dict().items() if n.startswith("mtp.")}
    fresh = _mtp_model()
    fresh.load_state_dict(new_heads, strict=False)

    def batch(tag: str) -> list[Request]:
        sp: dict[str, Any] = dict(max_new_tokens=16, temperature=1.0, top_k=8, ignore_eos=True)
        return [Request(f"{tag}{i}", TOK.encode("abcab" * (i + 1)), SamplingParams(**sp, seed=i)) for i in range(4)]

    def counts(engine: Any) -> tuple[int, int]:
        return engine.spec_stats["drafted"], engine.spec_stats["accepted"]

    engine = make_engine(_mtp_model(), speculative=spec)
    run(engine, batch("warm"))  # caches and the runners' fused weights in use
    before = counts(engine)
    assert engine.load_weights(new_heads.items())
    loaded = run(engine, batch("b"))
    after = tuple(x - y for x, y in zip(counts(engine), before))
    reference = make_engine(fresh, speculative=spec)
    want = run(reference, batch("b"))
    assert {k: o.output_ids for k, o in loaded.items()} == {k: o.output_ids for k, o in want.items()}
    assert after == counts(reference)
    stale = make_engine(_mtp_model(), speculative=spec)
    old = run(stale, batch("b"))
    assert counts(stale) != counts(reference) or any(old[k].output_ids != want[k].output_ids for k in want)


def test_nextn_needs_heads_and_is_a_serve_flag() -> None:
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings
    from mcore_rl.rollout.launch_flags import parse_server_args
    from tests.helpers import make_engine, tiny_model

    with pytest.raises(ValueError, match="NEXTN drafts with the model's MTP heads"):
        make_engine(tiny_model(), speculative=SpeculativeSettings("NEXTN"))
    spec = parse_server_args(["--speculative-algorithm", "NEXTN"]).engine_kwargs()["speculative"]
    assert spec.algorithm == "NEXTN"
