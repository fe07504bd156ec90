"""Re-Math (`mcore-rl diagnose remath_rollback`): the neuron scores, the selection, the rollback on
constructed weights (megatron and HF names), the activation statistics, the command end to end on HF
dirs; and the paper's two derived claims about refreshing, on a quadratic with the project's SGD."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from mcore_rl.diagnose import remath as rm

G = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


# ------------------------------------------------------------------------------ scores


def test_percentile_ranks_within_the_layer() -> None:
    assert rm.percentile(torch.tensor([3.0, 1.0, 2.0])).tolist() == [1.0, 0.0, 0.5]
    assert rm.percentile(torch.tensor([1.0, 1.0, 5.0])).tolist() == [0.25, 0.25, 1.0]
    assert rm.percentile(torch.tensor([7.0])).tolist() == [1.0]


def test_conflict_is_the_negative_cosine_and_zero_for_a_zero_update() -> None:
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    b = torch.tensor([[-2.0, 0.0], [1.0, 1.0], [0.0, 3.0], [1.0, 0.0]])
    assert rm.conflict(a, b).tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_score_is_zero_whenever_a_factor_is_zero() -> None:
    f = 5
    act_v, act_i = torch.tensor([0.0, 1, 2, 3, 4]), torch.tensor([4.0, 3, 2, 1, 5])
    upd_v = _randn(f, 6)
    upd_i = -upd_v.clone()
    upd_i[2] = 0.0  # no interfering update -> M = 0 (smallest magnitude) and C = 0
    upd_i[3] = torch.linalg.svd(upd_v[3:4], full_matrices=True).Vh[1] * 5  # orthogonal -> C = 0
    s = rm.neuron_scores(act_v, act_i, upd_v, upd_i)
    assert s["A"][0] == 0 and s["S"][0] == 0  # lowest victim activation -> A = 0
    assert s["M"][2] == 0 and s["S"][2] == 0
    assert abs(float(s["C"][3])) < 1e-6 and abs(float(s["S"][3])) < 1e-6
    assert float(s["S"][1]) > 0 and float(s["S"][4]) > 0  # opposed updates, shared activation
    assert torch.equal(s["S"], s["A"] * s["M"] * s["C"])


def test_aligned_neurons_rank_below_every_non_conflicting_one() -> None:
    f = 8
    upd_v = _randn(f, 4)
    upd_i = upd_v.clone()  # aligned: C = -1 ...
    upd_i[:4] = -upd_v[:4] * 0.01  # ... except neurons 0-3: opposed (C = 1), with tiny updates
    act = torch.arange(1.0, f + 1)
    s = rm.neuron_scores(act, act, upd_v, upd_i)
    assert (s["C"][4:] < 0).all() and (s["C"][:4] > 0).all()
    assert (s["A"][4:] > 0).all() and (s["M"][4:] > 0).all()
    assert float(s["S"][4:].max()) < float(s["S"][:4].min())
    chosen = rm.select({0: s["S"]}, 4 / 8)
    assert chosen[0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("budget", [0.0, 0.02, 0.1, 0.33, 1.0])
def test_selection_takes_ceil_budget_times_all_neurons(budget: float) -> None:
    scores = {0: _randn(30).double(), 1: _randn(20).double(), 5: _randn(50).double()}
    chosen = rm.select(scores, budget)
    assert sum(len(v) for v in chosen.values()) == math.ceil(budget * 100)
    picked = sorted((float(scores[layer][i]) for layer, ix in chosen.items() for i in ix.tolist()), reverse=True)
    rest = [
        float(v) for layer, t in scores.items() for i, v in enumerate(t.tolist()) if i not in chosen[layer].tolist()
    ]
    if picked and rest:
        assert min(picked) >= max(rest)
    with pytest.raises(ValueError):
        rm.select(scores, 1.5)


# ------------------------------------------------------------------------------ rollback on weights


def _hf_weights(layers: int = 2, f: int = 6, h: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(10, h, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "mlp.gate_proj.weight"] = torch.randn(f, h, generator=g)
        w[p + "mlp.up_proj.weight"] = torch.randn(f, h, generator=g)
        w[p + "mlp.down_proj.weight"] = torch.randn(h, f, generator=g)
        w[p + "self_attn.o_proj.weight"] = torch.randn(h, h, generator=g)
    return w


def _to_mcore(hf: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(layers):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[q + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[q + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
        out[q + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
    return out


def _acts(layers: int, f: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {i: torch.rand(f, generator=g) for i in range(layers)}


def test_rollback_takes_victim_values_on_chosen_neurons_only_in_both_layouts() -> None:
    layers, f = 2, 6
    before, victim, interfered = (_hf_weights(layers, f, seed=s) for s in (1, 2, 3))
    av, ai = _acts(layers, f, 4), _acts(layers, f, 5)
    new, summary = rm.plan(before, victim, interfered, av, ai, budget=0.25)
    assert summary["neurons"] == 12 and summary["rolled_back"] == 3
    layout = rm.mlp_neurons(interfered)
    chosen = {}
    for layer, (_, slices) in layout.items():
        v_new, v_vic, v_int = (rm.neuron_vectors(w, slices, f) for w in (new, victim, interfered))
        back = [i for i in range(f) if torch.equal(v_new[i], v_vic[i])]
        kept = [i for i in range(f) if torch.equal(v_new[i], v_int[i])]
        assert sorted(back + kept) == list(range(f)), layer  # every neuron is one or the other
        chosen[layer] = back
    assert sum(len(v) for v in chosen.values()) == 3
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert torch.equal(new[name], interfered[name])  # not an MLP neuron: untouched
    # the same weights under megatron names (fused [gate; up]) select and roll back the same neurons
    m_new, m_summary = rm.plan(*(_to_mcore(w, layers) for w in (before, victim, interfered)), av, ai, budget=0.25)
    assert m_summary["by_layer"] == summary["by_layer"]
    assert all(torch.equal(m_new[k], v) for k, v in _to_mcore(new, layers).items())


def test_plan_refuses_mismatched_inputs() -> None:
    w = _hf_weights()
    with pytest.raises(ValueError, match="other tensors"):
        rm.plan({**w, "extra": torch.zeros(1)}, w, w, _acts(2, 6, 0), _acts(2, 6, 1), 0.1)
    with pytest.raises(KeyError, match="layer 1"):
        rm.plan(w, w, w, {0: torch.ones(6)}, _acts(2, 6, 1), 0.1)
    with pytest.raises(ValueError, match="neurons"):
        rm.plan(w, w, w, {0: torch.ones(5), 1: torch.ones(6)}, _acts(2, 6, 1), 0.1)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(2, 3, bias=False)
        self.up_proj = torch.nn.Linear(2, 3, bias=False)
        self.down_proj = torch.nn.Linear(3, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class _Toy(torch.nn.Module):
    """`layers.<i>.mlp.down_proj`, as Hugging Face decoders name it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 2)
        self.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        for layer in self.layers:
            layer.mlp = _MLP()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer.mlp(x)
        return x


def test_activation_stats_are_the_masked_mean_abs_input_of_down_proj() -> None:
    torch.manual_seed(0)
    model = _Toy()
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    hooks = [
        model.layers[i].mlp.down_proj.register_forward_pre_hook(lambda _m, a, i=i: seen[i].append(a[0].detach()))
        for i in range(2)
    ]
    model(ids)
    for h in hooks:
        h.remove()
    stats = rm.mlp_activation_stats(model, [{"input_ids": ids, "attention_mask": mask}])
    for i in range(2):
        want = seen[i][0].abs()[mask.bool()].mean(0)
        torch.testing.assert_close(stats[i], want)
    with pytest.raises(ValueError, match="down_proj"):
        rm.mlp_activation_stats(torch.nn.Linear(2, 2), [])


def test_command_end_to_end_on_hf_dirs(tmp_path) -> None:
    from safetensors.torch import save_file

    from mcore_rl.cli import main
    from mcore_rl.convert.hf_checkpoint import HFCheckpoint

    layers, f = 2, 6
    weights = {name: _hf_weights(layers, f, seed=s) for name, s in (("before", 1), ("victim", 2), ("qa", 3))}
    for name, w in weights.items():
        (tmp_path / name).mkdir()
        save_file(w, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "qwen3", "which": name}))
    torch.save(_acts(layers, f, 4), tmp_path / "act_math.pt")
    torch.save(_acts(layers, f, 5), tmp_path / "act_qa.pt")
    out = tmp_path / "out"
    rc = main(
        [
            "diagnose",
            "remath_rollback",
            "--before",
            str(tmp_path / "before"),
            "--victim",
            str(tmp_path / "victim"),
            "--interfered",
            str(tmp_path / "qa"),
            "--act-victim",
            str(tmp_path / "act_math.pt"),
            "--act-interferer",
            str(tmp_path / "act_qa.pt"),
            "--budget",
            "0.25",
            "--output",
            str(out),
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0
    assert json.loads((out / "config.json").read_text())["which"] == "qa"
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["rolled_back"] == 3
    got = dict(HFCheckpoint(str(out)).items())
    want, _ = rm.plan(
        weights["before"], weights["victim"], weights["qa"], _acts(layers, f, 4), _acts(layers, f, 5), 0.25
    )
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # a second run refuses to overwrite it
    assert main(
        [
            "diagnose",
            "remath_rollback",
            "--before",
            str(tmp_path / "before"),
            "--victim",
            str(tmp_path / "victim"),
            "--interfered",
            str(tmp_path / "qa"),
            "--act-victim",
            str(tmp_path / "act_math.pt"),
            "--act-interferer",
            str(tmp_path / "act_qa.pt"),
            "--output",
            str(out),
        ]
    ) != 0 or pytest.fail("overwrote a non-empty output dir")


# ------------------------------------------------------------------------------ the theory, on a quadratic


def _quadratic(n: int, s_dim: int, mu: float, beta: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """H block-diagonal w.r.t. S = the first s_dim coordinates, with μI ⪯ H_S ⪯ βI; θ* random."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(s_dim, s_dim, generator=g, dtype=torch.float64))
    hs = q @ torch.diag(torch.linspace(mu, beta, s_dim, dtype=torch.float64)) @ q.T
    h = torch.zeros(n, n, dtype=torch.float64)
    h[:s_dim, :s_dim] = hs
    rest = torch.rand(n - s_dim, generator=g, dtype=torch.float64) * beta
    h[s_dim:, s_dim:] = torch.diag(rest)
    return h, torch.randn(n, generator=g, dtype=torch.float64)


def test_quadratic_damage_is_half_delta_h_delta() -> None:
    h, theta_star = _quadratic(8, 3, 0.5, 2.0, 0)

    def loss(t: torch.Tensor) -> torch.Tensor:
        d = t - theta_star
        return 0.5 * d @ h @ d + 1.25

    delta = torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    measured = loss(theta_star + delta) - loss(theta_star)
    hess = torch.autograd.functional.hessian(loss, theta_star)
    assert torch.allclose(hess, h)
    assert float(measured) == pytest.approx(float(0.5 * delta @ hess @ delta), rel=1e-12)


def test_sgd_refresh_contracts_the_conflict_subspace_geometrically() -> None:
    """Theorem 1, with the trainer's own SGD (`optimizer.name: sgd`) as the refresh."""
    from mcore_rl.config.schema import OptimizerConfig
    from mcore_rl.train.optimizer import build_optimizer

    n, s_dim, mu, beta = 10, 4, 0.3, 2.0
    h, theta_star = (t.float() for t in _quadratic(n, s_dim, mu, beta, 2))  # the wrapper trains fp32 params
    alpha = 1.0 / beta
    delta_b = torch.randn(n, generator=torch.Generator().manual_seed(3))
    model = torch.nn.Module()
    model.theta = torch.nn.Parameter((theta_star + delta_b).clone())
    cfg = replace(OptimizerConfig(), name="sgd", lr=alpha, clip_grad=0.0, lr_decay_style="constant")
    opt = build_optimizer([model], cfg, "fp32", 100)
    start = float(delta_b[:s_dim].norm())
    for t in range(1, 31):
        d = model.theta - theta_star
        (0.5 * d @ h @ d).backward()
        opt.step()
        opt.zero_grad()
        dist = float((model.theta.detach() - theta_star)[:s_dim].norm())
        assert dist <= (1 - alpha * mu) ** t * start * (1 + 1e-5) + 1e-6, t
    assert dist < 0.01 * start
    # negative control: a step above 2/β diverges on S, so the bound is not vacuous
    model.theta.data.copy_(theta_star + delta_b)
    opt_bad = build_optimizer([model], replace(cfg, lr=2.5 / beta), "fp32", 100)
    for _ in range(30):
        d = model.theta - theta_star
        (0.5 * d @ h @ d).backward()
        opt_bad.step()
        opt_bad.zero_grad()
    assert float((model.theta.detach() - theta_star)[:s_dim].norm()) > start


# ------------------------------------------------------------------------------ the refresh: early stop


def test_patience_stop_counts_evaluations_without_improvement_in_the_stage() -> None:
    from mcore_rl.recipes.remath import PatienceStop

    stop = PatienceStop(start_step=4, patience=2, metric="eval/math/score", min_delta=0.01)
    assert not stop.observe(2, {"eval/math/score": 0.9})  # before the stage: not its own
    assert not stop.observe(4, {"eval/math/score": 0.50})  # the baseline at the stage's start
    assert not stop.observe(6, {"eval/math/score": 0.60})  # improved
    assert not stop.observe(8, {"eval/math/score": 0.605})  # within min_delta: bad 1
    assert not stop.observe(9, {"eval/other": 1.0})  # no such metric: ignored
    assert stop.observe(10, {"eval/math/score": 0.55})  # bad 2 = patience
    assert (stop.best, stop.best_step, stop.bad) == (0.60, 6, 2)


def _refresh_data(tmp: str) -> dict:
    from tests.helpers import recipe

    data = recipe(tmp)
    data["data"]["mixture"]["stages"] = [
        {"start_step": 0},
        {"start_step": 1, "weights": {"fmt": 1.0}, "stop_patience": 1, "stop_min_delta": 1.0},
    ]
    return data


def test_refresh_stop_keys_validate(tmp_path) -> None:
    from mcore_rl.config import validate_rl_config
    from tests.helpers import cfg_of, errors_of

    tmp = str(tmp_path)
    data = _refresh_data(tmp)
    validate_rl_config(cfg_of(tmp, data), 1)
    assert "needs periodic evaluations" in errors_of(cfg_of(tmp, data, "eval.interval=0"))
    assert "needs rollout.runtime=sync" in errors_of(cfg_of(tmp, data, "rollout.runtime=async"))
    stages = data["data"]["mixture"]["stages"]
    stages[1]["weights"] = {"fmt": 1.0, "sum2": 1.0}
    assert "data.mixture.stages[1].stop_metric: the stage trains several domains" in errors_of(cfg_of(tmp, data))
    stages[1]["stop_metric"] = "eval/score"
    validate_rl_config(cfg_of(tmp, data), 1)
    stages[0]["stop_patience"] = 2
    assert "data.mixture.stages[0].stop_patience: only the last stage" in errors_of(cfg_of(tmp, data))
    stages[0]["stop_patience"] = -1
    assert "data.mixture.stages[0].stop_patience: must be >= 1" in errors_of(cfg_of(tmp, data))


def _refresh_world(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.runtime import run_rl
    from tests.helpers import cfg_of

    summary = run_rl(
        cfg_of(
            tmp, _refresh_data(tmp), f"run_dir={tmp}/run", "train.num_steps=6", "eval.interval=1", "eval.at_start=false"
        )
    )
    # stage 2 starts at step 1: the eval after step 1 is its baseline, the one after step 2 does not beat it
    # by min_delta=1.0 (no score can), so patience 1 ends the run there instead of at step 6
    assert summary["state"]["rl_step"] == 2, summary["state"]
    assert summary["refresh"] == {"stopped": True, "best": summary["refresh"]["best"], "best_step": 1}
    if rank == 0:
        with open(f"{tmp}/run/metrics.jsonl") as f:
            recs = [json.loads(line) for line in f]
        assert max(r["rl_step"] for r in recs) == 2
        assert [r["rl_step"] for r in recs if r.get("refresh/stopped")] == [2]


@pytest.mark.slow
def test_refresh_stage_stops_the_run_early(tmp_path) -> None:
    from tests.world import run_world

    run_world(1, _refresh_world, str(tmp_path))


def test_activations_command_on_a_tiny_hf_model(tmp_path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mcore_rl.cli import main
    from mcore_rl.data.tokenizer import load_tokenizer

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=384,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf")
    rows = [{"prompt": "12+34=", "response": "46"}, {"prompt": "7+8=", "response": "15"}, {"prompt": "1+1="}]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(
            [
                "diagnose",
                "remath_activations",
                str(tmp_path / "hf"),
                "--data",
                str(tmp_path / "math.jsonl"),
                "--batch-size",
                "2",
                "--output",
                str(tmp_path / "act.pt"),
            ]
        )
        == 0
    )
    got = rm.load_activations(str(tmp_path / "act.pt"))
    assert sorted(got) == [0, 1] and all(v.shape == (24,) for v in got.values())
    texts = rm.read_texts(str(tmp_path / "math.jsonl"), ["prompt", "response"], 10)
    assert texts == ["12+34= 46", "7+8= 15", "1+1="]
    want = rm.mlp_activation_stats(
        Qwen3ForCausalLM.from_pretrained(tmp_path / "hf"), rm.text_batches(texts, load_tokenizer(None), 2, 1024)
    )
    for layer in (0, 1):
        torch.testing.assert_close(got[layer], want[layer])
        assert (got[layer] > 0).all()
