"""`mcore-rl diagnose vgh` and `verif_horizon`: the pure quantities on inputs whose answer is known, and
each command end to end on a tiny model (no megatron: the embedded engine and the HF reference model)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from mcore_rl.diagnose.verif_horizon import (
    agreement,
    binned,
    doubling_edges,
    labels,
    parse_verifier,
    verification_horizon,
)
from mcore_rl.diagnose.vgh import binary_headroom, costates, entropy_bound, headroom, token_entropy, usable_signal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")


# ---------------------------------------------------------------- VGH: the reward headroom H_α


def test_headroom_is_nonnegative_and_zero_exactly_for_constant_groups():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, 8, generator=g, dtype=torch.float64) * 3 - 1
    for alpha in (1e-3, 0.5, 1.0, 7.0, 50.0, math.inf):
        h = headroom(rewards, alpha)
        assert (h >= 0).all() and (h > 0).all()  # non-constant rows: strictly positive (Jensen)
        constant = headroom([[1.0] * 8, [0.0] * 8, [0.37] * 5], alpha)
        assert torch.equal(constant, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("alpha", [0.1, 1.0, 4.0, 20.0])
def test_binary_headroom_matches_the_closed_form(alpha):
    G = 8
    rows = [[1.0] * k + [0.0] * (G - k) for k in range(G + 1)]
    h = headroom(rows, alpha)
    p = torch.arange(G + 1, dtype=torch.float64) / G
    closed = torch.log(1 - p + p * math.exp(alpha)) / alpha - p  # the paper's formula, written out
    torch.testing.assert_close(h, closed, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(binary_headroom(p, alpha), closed, rtol=1e-12, atol=1e-14)
    assert h[0] == 0 and h[-1] == 0 and (h[1:-1] > 0).all()


def test_headroom_limits_in_alpha():
    rows = [[0.0, 0.2, 1.0, 3.0], [1.0, -2.0], [5.0, 5.0, 4.0]]
    spread = torch.tensor([max(r) - sum(r) / len(r) for r in rows], dtype=torch.float64)
    assert headroom(rows, 1e-9).abs().max() < 1e-8  # -> 0 as α -> 0+
    torch.testing.assert_close(headroom(rows, math.inf), spread)
    assert (spread - headroom(rows, 1e4)).abs().max() < 2e-3  # -> max - mean as α -> inf (from below)
    assert (headroom(rows, 10.0) < headroom(rows, 100.0)).all()  # and grows with α
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="alpha must be > 0"):
            headroom(rows, bad)


# ---------------------------------------------------------------- VGH: the costate and the entropy bound


def _tiny_model(seed: int = 0, layers: int = 2):
    from mcore_rl.config.schema import ModelConfig
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    torch.manual_seed(seed)
    mc = ModelConfig(
        vocab_size=384,
        hidden_size=32,
        ffn_hidden_size=64,
        num_layers=layers,
        num_attention_heads=4,
        num_query_groups=2,
        max_position_embeddings=64,
    )
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).double().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _batch(B: int = 3, S: int = 9, prompt: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 384, (B, S), generator=g)
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, prompt - 1 : S - 1] = True
    return ids, targets, mask


def _logp(model, ids, targets, temperature=1.0, hidden=None):
    """log π(targets) at every position; `hidden` replaces the last layer's input (for autograd checks)."""
    handle = None
    if hidden is not None:
        handle = model.model.layers[-1].register_forward_pre_hook(lambda m, a: (hidden,) + tuple(a[1:]))
    try:
        logits = model(ids).logits / temperature
    finally:
        if handle is not None:
            handle.remove()
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _last_layer_input(model, ids):
    got = []
    handle = model.model.layers[-1].register_forward_pre_hook(lambda m, a: got.append(a[0].detach()))
    model(ids)
    handle.remove()
    return got[0]


def test_costate_is_the_gradient_of_the_future_surrogate_terms_at_every_position():
    """λ̂_t = ∂/∂h_t Σ_{k≥t} Â ℓ_k, each t computed on its own, equals the one-backward λ̂ (causality);
    the terms k < t contribute nothing."""
    model = _tiny_model()
    ids, targets, mask = _batch()
    adv = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)
    lam, logits = costates(model, ids, targets, mask, adv, temperature=0.8)
    h0 = _last_layer_input(model, ids)
    for t in range(3, 8):
        h = h0.clone().requires_grad_(True)
        lp = _logp(model, ids, targets, 0.8, hidden=h)
        future = mask.clone()
        future[:, :t] = False
        (grad,) = torch.autograd.grad((lp * future * adv[:, None]).sum(), h)
        torch.testing.assert_close(lam[:, t], grad[:, t], rtol=1e-9, atol=1e-12)
        past = mask.clone()
        past[:, t:] = False
        (grad_past,) = torch.autograd.grad((_logp(model, ids, targets, 0.8, hidden=h) * past * adv[:, None]).sum(), h)
        assert grad_past[:, t].abs().max() == 0
    assert logits.shape == (3, 9, 384) and not logits.requires_grad


def test_costate_carries_the_attention_path_and_ends_with_the_local_term():
    """Before the last response token λ̂_t ≠ Â ∂ℓ_t/∂h_t: the J^T λ̂_{t+1} term through attention is in it
    (a gradient taken at the last layer's output would lack it); at the last token only the local term is left."""
    model = _tiny_model()
    ids, targets, mask = _batch()
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    lam, _ = costates(model, ids, targets, mask, adv)
    h0 = _last_layer_input(model, ids)
    last = 7
    for t in (3, 5, last):
        h = h0.clone().requires_grad_(True)
        only_t = torch.zeros_like(mask)
        only_t[:, t] = True
        (local,) = torch.autograd.grad((_logp(model, ids, targets, hidden=h) * only_t * adv[:, None]).sum(), h)
        if t == last:
            torch.testing.assert_close(lam[:, t], local[:, t], rtol=1e-9, atol=1e-12)
        else:
            assert (lam[:, t] - local[:, t]).norm() > 1e-3 * lam[:, t].norm()


def test_costate_scales_with_the_advantage_and_vanishes_without_it():
    model = _tiny_model()
    ids, targets, mask = _batch()
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    lam, _ = costates(model, ids, targets, mask, adv)
    lam3, _ = costates(model, ids, targets, mask, 3 * adv)
    assert (lam3 - 3 * lam).norm() < 1e-5 * lam.norm()  # linear in Â (the model computes parts in fp32)
    zero, _ = costates(model, ids, targets, mask, torch.zeros(3, dtype=torch.float64))
    assert zero.abs().max() == 0 and lam.abs().max() > 0
    assert lam[:, -1].abs().max() == 0  # the position after the last target predicts nothing


def test_entropy_bound_is_zero_for_a_sure_token_and_one_for_uniform():
    V = 384
    uniform = torch.zeros(1, V)
    sure = torch.full((1, V), -1e4)
    sure[0, 7] = 0.0
    assert torch.isclose(token_entropy(uniform), torch.tensor([math.log(V)], dtype=torch.float64)).all()
    assert torch.isclose(entropy_bound(uniform), torch.ones(1, dtype=torch.float64)).all()
    assert entropy_bound(sure).item() == pytest.approx(0.0, abs=1e-6)
    two = torch.full((1, V), -1e4)
    two[0, :2] = 0.0
    assert entropy_bound(two).item() == pytest.approx(math.sqrt(math.log(2) / math.log(V)), rel=1e-9)


def test_usable_signal_is_all_of_sigma_at_zero_entropy_and_none_at_uniform():
    sq = torch.tensor([1.0, 4.0, 0.25, 2.0])
    assert usable_signal(sq, torch.zeros(4)) == {"sigma": 1.8125, "lambda": 0.0, "usable_signal": 1.8125}
    assert usable_signal(sq, torch.ones(4))["usable_signal"] == 0.0
    half = usable_signal(sq, torch.tensor([0.0, 0.5, 1.0, 0.5]))
    assert half["lambda"] == pytest.approx((4 * 0.5 + 0.25 + 2 * 0.5) / 4)
    with pytest.raises(ValueError, match="no response tokens"):
        usable_signal(torch.zeros(0), torch.zeros(0))


# ---------------------------------------------------------------- VerifHorizon: agreement statistics


def test_agreement_and_kappa_on_a_known_table():
    # reference pass / other pass: 20 both pass, 5 ref only, 10 other only, 15 both fail
    ref = [True] * 20 + [True] * 5 + [False] * 10 + [False] * 15
    oth = [True] * 20 + [False] * 5 + [True] * 10 + [False] * 15
    a = agreement(ref, oth)
    # p_o = 35/50, p_e = .5*.6 + .5*.4 = .5 -> κ = .4; FPR = 10/25, FNR = 5/25
    assert a["agreement"] == pytest.approx(0.7) and a["kappa"] == pytest.approx(0.4)
    assert a["fpr"] == pytest.approx(0.4) and a["fnr"] == pytest.approx(0.2) and a["n"] == 50
    assert agreement(ref, ref)["kappa"] == 1.0
    flipped = agreement([True, False] * 10, [False, True] * 10)
    assert flipped["kappa"] == pytest.approx(-1.0) and flipped["fpr"] == 1.0 and flipped["fnr"] == 1.0
    constant = agreement([True] * 4, [True] * 4)
    assert constant["kappa"] is None and constant["fpr"] is None and constant["fnr"] == 0.0
    with pytest.raises(ValueError):
        agreement([True], [True, False])


def test_binned_agreement_and_the_horizon():
    # short responses: the verifiers agree; long ones: the looser one passes what the reference fails
    lengths = [1] * 8 + [3] * 8 + [12] * 8
    ref = [True, False] * 4 + [True, False] * 4 + [True, False] * 4
    oth = [True, False] * 4 + [True, False] * 3 + [True, True] + [True] * 8
    assert doubling_edges(12) == [0, 1, 2, 4, 8, 16]
    rows = binned(lengths, ref, oth, doubling_edges(12))
    assert [r["tokens"] for r in rows] == ["[1,2)", "[2,4)", "[8,16)"]
    assert rows[0]["kappa"] == 1.0 and rows[1]["kappa"] == pytest.approx(0.75) and rows[2]["kappa"] == 0.0
    assert rows[2]["fpr"] == 1.0 and rows[1]["fpr"] == 0.25
    assert verification_horizon(rows, 0.6) == 8
    assert verification_horizon(rows, 0.8) == 2
    assert verification_horizon(rows, 0.8, min_bin=9) is None
    over = binned(lengths, ref, oth, [0, 4])  # the open last bin takes the long ones
    assert [r["tokens"] for r in over] == ["[0,4)", "[4,inf)"] and over[1]["n"] == 8
    with pytest.raises(ValueError, match="increasing"):
        binned(lengths, ref, oth, [4, 2])


def test_parse_verifier():
    assert parse_verifier("addition") == ("addition", {})
    assert parse_verifier('formatting={"pattern": "\\\\d+"}') == ("formatting", {"pattern": "\\d+"})
    assert parse_verifier("tests.reward_fns:digit_count") == ("tests.reward_fns:digit_count", {})
    with pytest.raises(ValueError, match="not JSON"):
        parse_verifier("formatting={pattern}")
    assert labels([("formatting", {}), ("addition", {}), ("formatting", {"pattern": "x"})]) == [
        "formatting",
        "addition",
        "formatting#2",
    ]


# ---------------------------------------------------------------- the commands, end to end


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """An HF-format directory of a 2-layer model (as `mcore-rl convert mcore-to-hf` writes one)."""
    path = str(tmp_path_factory.mktemp("hf_model"))
    model = _tiny_model(seed=3).float()
    model.save_pretrained(path, safe_serialization=True)
    return path


RECIPE = [
    "rollout.quantization=none",
    "rollout.max_new_tokens=16",
    "eval.num_prompts=8",
    "init.sft_steps=0",
    "reward.name=tests.reward_fns:digit_count",
]


def test_vgh_command_end_to_end(tiny_hf_model, tmp_path, capsys):
    """Sampled rollouts with a reward an untrained model gets (digits in the completion): a mixed pass rate,
    so the costate and P_gap are positive and the headroom is the mean of the closed form per prompt."""
    from mcore_rl.cli import main

    out = tmp_path / "vgh.json"
    argv = [
        "diagnose",
        "vgh",
        "--config",
        DEMO,
        *RECIPE,
        "--model",
        tiny_hf_model,
        "--prompts",
        "6",
        "--group-size",
        "4",
        "--alpha",
        "1",
        "--alpha",
        "inf",
        "--threshold",
        "1",
        "--temperature",
        "1.5",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "usable_signal" in printed and "P_gap" in printed
    r = json.loads(out.read_text())
    assert r["policy"] == tiny_hf_model and r["prompts"] == 6 and r["group_size"] == 4
    vg, rw = r["value_gradient"], r["reward"]
    assert 0 < rw["pass_rate"] < 1 and rw["headroom_1_minus_pass_rate"] == pytest.approx(1 - rw["pass_rate"])
    assert vg["response_tokens"] > 0 and vg["sigma_costate_sq"] > 0
    assert 0 < vg["usable_signal"] < vg["sigma_costate_sq"]
    assert vg["usable_signal"] == pytest.approx(vg["sigma_costate_sq"] - vg["lambda_entropy_bound"])
    assert 0 < vg["entropy_bound_mean"] <= 1
    h1, hinf = r["headroom"]
    assert h1["alpha"] == 1 and 0 < h1["H_alpha"] < hinf["H_alpha"]
    assert h1["P_gap"] == pytest.approx(vg["usable_signal"] * h1["H_alpha"])
    # the same command again: the same seeded rollouts, the same numbers
    out2 = tmp_path / "vgh2.json"
    assert main(argv[:-1] + [str(out2)]) == 0
    assert json.loads(out2.read_text()) == r


def test_commands_say_what_is_missing(tmp_path, capsys):
    from mcore_rl.cli import main

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "iter_0000010").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    assert main(["diagnose", "vgh", "--config", DEMO, "--model", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "is a run directory" in err and "checkpoint.save_dir" in err and "mcore-rl convert mcore-to-hf" in err
    assert main(["diagnose", "vgh", "--config", DEMO, "--model", str(run_dir / "checkpoints")]) == 2
    err = capsys.readouterr().err
    assert "is a megatron checkpoint" in err and "--model DIR" in err
    assert f"--input {run_dir / 'checkpoints'}" in err
    assert main(["diagnose", "vgh", "--config", DEMO, "--model", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert (
        main(
            [
                "diagnose",
                "verif_horizon",
                "--config",
                DEMO,
                "--verifier",
                "addition",
                "--verifier",
                "formatting",
                "--samples",
                str(run_dir),
            ]
        )
        == 2
    )
    assert "runs do not save their rollouts" in capsys.readouterr().err
    assert main(["diagnose", "verif_horizon", "--config", DEMO, "--verifier", "addition"]) == 2
    assert "two or more --verifier" in capsys.readouterr().err
    assert main(["diagnose", "vgh", "--config", DEMO, "rollout.group_size=0"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err


def test_verif_horizon_command_on_saved_and_on_sampled_rollouts(tiny_hf_model, tmp_path, capsys):
    """Saved rollouts with a known answer: the addition verifier and a looser "all digits" check agree on the
    short ones (right answers, junk) and not on the long ones (a digit string passes the loose check
    whatever it is); then the same on rollouts sampled from a tiny model."""
    from mcore_rl.cli import main

    rows = []
    for a, b in [(12, 34), (50, 7), (99, 99), (3, 4)]:
        right = str(a + b)[::-1]
        rows += [
            {"prompt": f"{a:02d}+{b:02d}=", "completion": right, "label": None, "response_tokens": 2},
            {"prompt": f"{a:02d}+{b:02d}=", "completion": "x", "label": None, "response_tokens": 2},
            {"prompt": f"{a:02d}+{b:02d}=", "completion": "1234567", "label": None, "response_tokens": 9},
            {"prompt": f"{a:02d}+{b:02d}=", "completion": right + "0", "label": None, "response_tokens": 9},
        ]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "vh.json"
    loose = 'formatting={"pattern": "[0-9]+"}'
    assert (
        main(
            [
                "diagnose",
                "verif_horizon",
                "--config",
                DEMO,
                "--samples",
                str(samples),
                "--verifier",
                "addition",
                "--verifier",
                loose,
                "--min-bin",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["rollouts"] == 16 and r["reference"] == "addition"
    assert [v["pass_rate"] for v in r["verifiers"]] == [0.5, 0.75] and r["verifiers"][1]["errors"] == 0
    cmp = r["formatting_vs_addition"]
    short, long_ = cmp["by_length"]
    assert short["tokens"] == "[2,4)" and short["kappa"] == 1.0 and short["fpr"] == 0.0
    assert long_["tokens"] == "[8,16)" and long_["agreement"] == 0.5 and long_["fpr"] == 1.0 and long_["kappa"] == 0.0
    assert cmp["verification_horizon_tokens"] == 8 and cmp["overall"]["n"] == 16
    capsys.readouterr()

    out = tmp_path / "vh_sampled.json"
    assert (
        main(
            [
                "diagnose",
                "verif_horizon",
                "--config",
                DEMO,
                *RECIPE,
                "--model",
                tiny_hf_model,
                "--prompts",
                "3",
                "--group-size",
                "2",
                "--verifier",
                "tests.reward_fns:digit_count",
                "--verifier",
                loose,
                "--verifier",
                'formatting={"pattern": ".*"}',
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["rollouts"] == 6 and r["rollouts_from"] == tiny_hf_model
    by_length = r["formatting_vs_tests.reward_fns:digit_count"]["by_length"]
    assert sum(b["n"] for b in by_length) == 6
    anything = r["formatting#2_vs_tests.reward_fns:digit_count"]["overall"]  # passes every rollout
    assert anything["other_pass"] == 1.0 and anything["fnr"] in (0.0, None)
