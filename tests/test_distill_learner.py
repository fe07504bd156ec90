"""The learner's use of the "distill" kind: the `distill:` config section, teacher scores on the
sequence view, the horizon cut of the rollouts, the student's log-probs at the teacher's top-k ids
from the vocab-parallel logits, and learner steps on a real tiny megatron model (TP=2) that lower
the KL to a teacher through either phase.

The teacher of the learner test is a fixed distribution q over the vocabulary (the same at every
position), q ∝ exp(2·z/std(z)) with z = W_out·u for the student's initial output weights W_out and a
random hidden direction u: a teacher far from the (near-uniform) student that it can reach by
moving its hidden states. Its `TeacherScores` are built by hand from q, as an engine teacher would
return them.
The loss-phase path uses a forward KL over the teacher's top-k registered here, under a test name:
the learner calls it as it calls any registered function.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algos import registry
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, phase
from mcore_rl.algos.policy_loss import aggregate, masked_mean
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.data.samples import Prompt, Sample, TeacherScores
from mcore_rl.train.distillation import add_packed_topk, generation_budget, teacher_view
from mcore_rl.train.logprobs import vocab_parallel_topk_stats
from mcore_rl.train.packing import build_microbatches, sequence_view
from tests.helpers import TINY, _samples, tiny
from tests.world import run_world


@registry.register("distill", "test_topk_forward_kl")
@phase("loss")
def topk_forward_kl(batch: DistillBatch) -> DistillTerms:
    """Σ_{v ∈ teacher top-k} q(v) (log q(v) - log π_θ(v)) per token (forward KL restricted to the top-k)."""
    q = batch.teacher_topk_logp.exp()
    per_token = (q * (batch.teacher_topk_logp - batch.student_topk_logp)).sum(-1)
    loss_sum, _ = aggregate(per_token, batch.mask, batch.agg, batch.norm_length)
    return DistillTerms(loss_sum=loss_sum, metrics={"kl": masked_mean(per_token.detach(), batch.mask)})


# ------------------------------------------------------------------------------------ config

YAML = """
distill:
  rl: false
  top_k: 4
  losses:
    - {name: reverse_kl, coef: 1.0}
    - {name: seed, coef: 0.01, options: {beta: 5.0}}
  horizon: {schedule: fixed, rho: 0.5, domains: [arithmetic]}
teachers:
  - {name: old_self, kind: frozen, top_k: 4}
"""


def test_distill_section_loads_from_yaml_and_validates(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(YAML)
    cfg = load_config(RLConfig, str(path), TINY)
    validate_rl_config(cfg, 1)
    d = cfg.distill
    assert [(x.name, x.coef, x.options) for x in d.losses] == [("reverse_kl", 1.0, {}), ("seed", 0.01, {"beta": 5.0})]
    assert d.rl is False and d.top_k == 4 and d.horizon.rho == 0.5 and d.horizon.domains == ["arithmetic"]
    assert tiny().distill.losses == []  # off by default


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["distill.losses=[{name: nope}]"], "distill.losses[0].name: unknown distill function 'nope'; registered: "),
        (
            ["distill.losses=[{name: power_opd, options: {alpha: 2.0, beta: 1}}]"],
            "distill.losses[0].options.beta: is not an option of 'power_opd'; its options: alpha, normalize",
        ),
        (
            ["distill.losses=[{name: reverse_kl}, {name: reverse_kl}]"],
            "distill.losses[1].name: 'reverse_kl' is listed twice",
        ),
        (["distill.losses=[{name: reverse_kl, coef: -1}]"], "distill.losses[0].coef: must be >= 0"),
        (["distill.rl=false"], "distill.rl: is false (distillation alone) but distill.losses is empty"),
        (["distill.top_k=-1"], "distill.top_k: must be >= 0"),
        (["distill.horizon.schedule=fixed", "distill.horizon.rho=0.5"], "distill.horizon.schedule: is 'fixed' but"),
        (["distill.losses=[{name: popd}]", "distill.horizon.schedule=fixed"], "distill.horizon.rho: a fixed horizon"),
        (
            ["distill.losses=[{name: popd}]", "distill.horizon.schedule=fixed", "distill.horizon.tokens=9"],
            "distill.horizon.tokens: must be in [1, rollout.max_new_tokens=4], got 9",
        ),
        (
            ["distill.losses=[{name: popd}]", "distill.horizon.schedule=growing"],
            "distill.horizon.h0: the growing horizon",
        ),
        (["distill.losses=[{name: antisd, options: {state: 1}}]"], "distill.losses[0].options.state: is not an option"),
        (
            ["distill.effopd.enabled=true", "rollout.runtime=async", "rollout.max_staleness=1"],
            "distill.effopd.enabled: EffOPD scores candidate",
        ),
        (["distill.effopd.enabled=true", "algorithm.mismatch.name=mipu"], "distill.effopd.enabled: EffOPD and MIPU"),
        (["distill.effopd.enabled=true", "distill.effopd.num_candidates=0"], "distill.effopd.num_candidates"),
        # what a function needs (`@needs`) must be there before training starts
        (["distill.losses=[{name: reverse_kl}]", "teachers=[]"], "distill.losses: no teacher fills Sample.teacher"),
        (
            ["distill.losses=[{name: tropd_fkl}]", "distill.top_k=0"],
            "distill.top_k: is 0, but 'tropd_fkl' needs the teacher's top-k",
        ),
        (
            ["distill.losses=[{name: tropd_fkl}]", "distill.top_k=8", "teachers=[{kind: frozen, top_k: 4}]"],
            "teachers[0].top_k: is 4, but 'tropd_fkl' reads the top 8",
        ),
        # Direct-OPD: every teacher a distilled sample can reach needs a reference (an engine teacher)
        (
            ["distill.losses=[{name: direct_opd}]", "distill.top_k=4", "teachers=[{kind: frozen, top_k: 4}]"],
            "teachers[0].reference: is not set, but 'direct_opd' needs a reference teacher",
        ),
        (
            [
                "distill.losses=[{name: direct_opd}]",
                "distill.top_k=4",
                "teachers=[{kind: engine, name: t, urls: ['http://a'], top_k: 4, reference: r, domains: [x]}, "
                "{kind: engine, name: r, urls: ['http://b']}, {kind: frozen, top_k: 4}]",
            ],
            "teachers[2].reference: is not set, but 'direct_opd' needs a reference teacher (π_Tref: teacher_ref_topk_logp) "
            "for the samples routed to 'frozen2'",
        ),
        # Direct-OPD's own KL reads π_ref (the student's starting weights); its α options are checked
        (
            [
                "distill.losses=[{name: direct_opd}]",
                "distill.top_k=4",
                "teachers=[{kind: engine, name: t, urls: ['http://a'], top_k: 4, reference: r}, "
                "{kind: engine, name: r, urls: ['http://b']}]",
            ],
            "algorithm.reference_model: is off, but distill.losses[0] 'direct_opd' reads the student's reference model",
        ),
        (
            [
                "distill.losses=[{name: direct_opd, options: {alpha_min: 3.0}}]",
                "distill.top_k=4",
                "algorithm.reference_model=true",
                "teachers=[{kind: engine, name: t, urls: ['http://a'], top_k: 4, reference: r}, "
                "{kind: engine, name: r, urls: ['http://b']}]",
            ],
            "distill.losses[0].options: distill 'direct_opd': options.alpha_min (3.0) is above alpha_max (2.5)",
        ),
        (
            [
                "distill.losses=[{name: direct_opd}]",
                "distill.top_k=4",
                "algorithm.kl_coef=0.01",
                "teachers=[{kind: engine, name: t, urls: ['http://a'], top_k: 4, reference: r}, "
                "{kind: engine, name: r, urls: ['http://b']}]",
            ],
            "algorithm.kl_coef: is 0.01, but distill.losses[0] 'direct_opd' carries its own adaptive KL to π_ref",
        ),
        # TrOPD's imitation term: nothing generates teacher prefixes, so it would train nothing
        (
            ["distill.losses=[{name: tropd_imitation}]"],
            "distill.losses[0].name: 'tropd_imitation' needs DistillBatch.teacher_generated, which no rollout",
        ),
        # a value outside an option's Literal choices (it would silently mean the default)
        (
            ["distill.losses=[{name: stepopsd, options: {weights: random}}]"],
            "distill.losses[0].options.weights: 'random' is not one of 'teacher', 'shuffled'",
        ),
        # SDAR has one weight, the entry's coef
        (
            ["distill.losses=[{name: sdar, options: {coef: 0.01}}]"],
            "distill.losses[0].options.coef: is not an option of 'sdar'; its options: beta, gate",
        ),
        (
            ["teachers=[{kind: frozen, reference: r}, {kind: engine, name: r, urls: ['http://b']}]"],
            "teachers[0].reference: only engine teachers have a reference",
        ),
        (
            ["teachers=[{kind: engine, name: t, urls: ['http://a'], reference: nobody}]"],
            "teachers[0].reference: 'nobody' is not the name of another teacher",
        ),
        (
            ["teachers=[{kind: engine, name: t, urls: ['http://a'], reference: t}]"],
            "teachers[0].reference: 't' is not the name of another teacher",
        ),
        (
            ["teachers=[{kind: engine, name: t, urls: ['http://a'], reference: r}, {kind: frozen, name: r}]"],
            "teachers[0].reference: 'r' is a 'frozen' teacher; a reference is an engine teacher",
        ),
        (
            [
                "teachers=[{kind: engine, name: t, urls: ['http://a'], reference: r}, "
                "{kind: engine, name: r, urls: ['http://b'], reference: t}]"
            ],
            "teachers[1].reference: 'r' is the reference of 't' and cannot have a reference itself",
        ),
        (
            [
                "teachers=[{kind: engine, name: t, urls: ['http://a'], reference: r}, "
                "{kind: engine, name: r, urls: ['http://b'], domains: [x], top_k: 2}]"
            ],
            "teachers[1].domains: 'r' is a reference teacher",
        ),
        (
            [
                "teachers=[{kind: engine, name: t, urls: ['http://a'], reference: r}, "
                "{kind: engine, name: r, urls: ['http://b'], top_k: 2}]"
            ],
            "teachers[1].top_k: 'r' is a reference teacher",
        ),
        (
            ["teachers=[{kind: engine, name: t, urls: ['http://a'], reference: r}, {kind: engine, name: r}]"],
            "teachers[1].urls: an engine teacher needs either urls",
        ),
    ],
)
def test_bad_distill_config_fails_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_rl_config(tiny(*overrides), 1)
    assert message in str(err.value)


def test_direct_opd_with_a_reference_teacher_validates():
    """A reference teacher is no default teacher (never routed to), and its top_k is not checked."""
    cfg = tiny(
        "distill.losses=[{name: direct_opd}]",
        "distill.top_k=4",
        "algorithm.reference_model=true",
        "teachers=[{kind: engine, name: t, urls: ['http://a'], top_k: 4, reference: r}, "
        "{kind: engine, name: r, urls: ['http://b']}]",
    )
    validate_rl_config(cfg, 1)


def test_an_unknown_distill_key_fails_while_loading():
    with pytest.raises(ConfigError, match="did you mean 'distill.top_k'"):
        tiny("distill.topk=3")


def test_stateful_terms_get_their_state_once_and_it_round_trips():
    from mcore_rl.train.rl_step import Learner

    cfg = tiny("distill.losses=[{name: antisd}, {name: reverse_kl}]")
    learner = Learner(cfg, chunks=[], optimizer=None, ref_chunks=None, pad_id=0)
    gate = learner.distill[0].state
    assert gate is not None and learner.distill[1].state is None
    gate.update(1.5)
    saved = learner.distill_state_dict()
    assert list(saved) == ["antisd"] and saved["antisd"]["warm_medians"] == [1.5]
    fresh = Learner(cfg, chunks=[], optimizer=None, ref_chunks=None, pad_id=0)
    assert fresh.distill[0].state is not gate and fresh.distill[0].state.warm_medians == []
    fresh.load_distill_state(saved)
    assert fresh.distill[0].state.state_dict() == gate.state_dict()


def test_sdar_has_one_weight_the_loss_entrys_coef():
    """`{name: sdar, coef: 0.01}` is λ_SDAR = 0.01 in the loss the learner adds (not 0.01 × a
    default 0.01 of the function's own): the term is coef · Σ_agg σ(βΔ)·(log π_T − log π_θ)."""
    from mcore_rl.train.distillation import call_terms, distill_terms

    (term,) = distill_terms(tiny("distill.losses=[{name: sdar, coef: 0.01}]"))
    g = torch.Generator().manual_seed(3)
    student = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    teacher = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.float64)
    batch = DistillBatch(student_logp=student, old_logp=student, teacher_logp=teacher, mask=mask)
    _, _, loss = call_terms([term], batch, {})
    gap = teacher - student
    assert float(loss) == pytest.approx(0.01 * float((torch.sigmoid(5.0 * gap) * gap).sum()), rel=1e-12)


def test_a_loss_entry_without_coef_gets_the_terms_own_default_weight():
    """`{name: sdar}` weighs λ_SDAR = 0.01 and `{name: seed}` λ_opd = 0.01 (the papers'), in the loss
    the learner adds; a given coef wins (0 included); a term without a default weighs 1; a YAML
    `coef: null` is the default too, and a negative coef is still refused."""
    from mcore_rl.train.distillation import call_terms, distill_terms

    terms = distill_terms(tiny("distill.losses=[{name: sdar}, {name: seed, coef: null}, {name: reverse_kl}]"))
    assert [(t.name, t.coef) for t in terms] == [("sdar", 0.01), ("seed", 0.01), ("reverse_kl", 1.0)]
    given = distill_terms(tiny("distill.losses=[{name: sdar, coef: 1}, {name: seed, coef: 0}]"))
    assert [(t.name, t.coef) for t in given] == [("sdar", 1.0), ("seed", 0.0)]
    g = torch.Generator().manual_seed(4)
    student = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    teacher = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    batch = DistillBatch(
        student_logp=student, old_logp=student, teacher_logp=teacher, mask=torch.ones(2, 5, dtype=torch.float64)
    )
    _, _, loss = call_terms(terms[:1], batch, {})
    gap = teacher - student
    assert float(loss) == pytest.approx(0.01 * float((torch.sigmoid(5.0 * gap) * gap).sum()), rel=1e-12)
    frozen = "teachers=[{kind: frozen}]"
    validate_rl_config(tiny("distill.losses=[{name: sdar}, {name: seed, coef: null}]", frozen), 1)
    with pytest.raises(ConfigError, match=r"distill.losses\[0\].coef: must be >= 0"):
        validate_rl_config(tiny("distill.losses=[{name: sdar, coef: -0.5}]", frozen), 1)


def test_ui_mopd_weighs_beta_and_its_gate_reads_the_learners_group_mean():
    """`{name: ui_mopd}` weighs β = 0.01 (the paper's) in the learner's loss; `tau_kl` is its one option
    (a wrong key fails naming it); the gate reads `group_mean_reward`, which the learner computes
    over the whole batch (`distill_group_mean_reward`, a per-sample key sliced into micro-batches)."""
    from mcore_rl.algos.distill.base import group_mean
    from mcore_rl.train.distillation import DISTILL_KEYS, call_terms, distill_terms

    assert "distill_group_mean_reward" in DISTILL_KEYS
    (term,) = distill_terms(tiny("distill.losses=[{name: ui_mopd, options: {tau_kl: 0.5}}]"))
    assert term.coef == 0.01
    g = torch.Generator().manual_seed(5)
    student = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    teacher = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.float64)
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 1])
    batch = DistillBatch(
        student_logp=student,
        old_logp=student,
        teacher_logp=teacher,
        mask=mask,
        group_mean_reward=group_mean(rewards, groups),
    )
    _, _, loss = call_terms([term], batch, {})
    d = teacher - student
    assert float(loss) == pytest.approx(0.01 * float((torch.expm1(d[1]) - d[1]).sum()), rel=1e-12)  # group 0 off
    frozen = "teachers=[{kind: frozen}]"
    with pytest.raises(ConfigError, match=r"distill.losses\[0\].options.tau: is not an option of 'ui_mopd'"):
        validate_rl_config(tiny("distill.losses=[{name: ui_mopd, options: {tau: 1}}]", frozen), 1)


# ------------------------------------------------------------------------------------ teacher view, packing, horizon


def _teacher(logp, topk=None, error=None):
    ids = None if topk is None else [[(7 * j + c) % 300 for c in range(topk)] for j in range(len(logp))]
    lps = None if topk is None else [[-0.5] * topk for _ in logp]
    return TeacherScores(logp=logp, topk_ids=ids, topk_logp=lps, source="test", error=error)


def test_teacher_view_leaves_samples_without_usable_scores_undistilled():
    samples = _samples()[:5]
    lengths = [len(s.response_ids) for s in samples]
    samples[0].teacher = _teacher([-1.0] * lengths[0], topk=2)
    samples[1].teacher = None
    samples[2].teacher = TeacherScores(error="teacher http://x: timeout")
    samples[3].teacher = _teacher([-2.0] * lengths[3])  # no top-k: not distilled when top-k is asked for
    samples[4].teacher = _teacher([-3.0] * lengths[4], topk=3)
    t = max(lengths)
    tv = teacher_view(samples, t, top_k=2, horizons=[None, None, None, None, 1])
    assert tv.mask.sum(1).tolist() == [lengths[0], 0, 0, 0, 1]  # sample 4: horizon 1
    assert tv.logp[0, : lengths[0]].eq(-1.0).all() and tv.scored_frac == pytest.approx(2 / 5)
    assert tv.topk_ids.shape == (5, t, 2) and tv.topk_ids[4, 0].tolist() == [0, 1]  # the first 2 of 3
    no_topk = teacher_view(samples, t, top_k=0, horizons=[None] * 5)
    assert no_topk.mask.sum(1).tolist() == [lengths[0], 0, 0, lengths[3], lengths[4]] and no_topk.topk_ids is None
    with pytest.raises(ValueError, match="outside the student.s vocabulary of 5 "):
        teacher_view(samples, t, top_k=2, horizons=[None] * 5, vocab_size=5)
    samples[0].teacher.logp = samples[0].teacher.logp[:-1]
    with pytest.raises(ValueError, match="one log-prob per response token"):
        teacher_view(samples, t, top_k=0, horizons=[None] * 5)


def test_teacher_top_k_ids_sit_at_the_packed_positions_of_their_tokens():
    samples = _samples()
    view = sequence_view(samples)
    n, t = view.mask.shape
    ids = torch.arange(n * t * 3).view(n, t, 3) % 384
    mbs = build_microbatches(
        samples, list(range(n)), 16, 2, 0, 1, 0, t, {"teacher_topk_ids": ids, "response_mask": view.mask}
    )
    add_packed_topk(mbs)
    for mb in mbs:
        flat = mb["label_topk_ids"].reshape(-1, 3)
        assert mb["label_topk_ids"].shape == (*mb["labels"].shape, 3)
        for k, i in enumerate(mb["seq_index"].tolist()):
            m = len(samples[i].response_ids)
            assert torch.equal(flat[mb["seq_pos"][k, :m]], ids[i, :m])


def test_generation_budget_is_cut_at_the_horizon_of_the_step():
    p = Prompt(0, "1+1=", [1, 2], domain="arithmetic")
    other = Prompt(1, "x", [1], domain="code")
    cfg = tiny(
        "rollout.max_new_tokens=8",
        "distill.losses=[{name: popd}]",
        "distill.horizon.schedule=growing",
        "distill.horizon.h0=2",
        "distill.horizon.delta_h=3",
        "distill.horizon.delta_k=2",
        "distill.horizon.domains=[arithmetic]",
    )
    assert [generation_budget(cfg, p, k) for k in (0, 1, 2, 4, 9)] == [2, 2, 5, 8, 8]
    assert generation_budget(cfg, other, 0) == 8  # not a distilled domain
    p.max_new_tokens = 1
    assert generation_budget(cfg, p, 4) == 1
    topd = tiny(
        "rollout.max_new_tokens=8",
        "distill.losses=[{name: topd}]",
        "distill.horizon.schedule=fixed",
        "distill.horizon.rho=0.3",
    )
    assert generation_budget(topd, other, 5) == 2  # floor(0.3 * 8), every domain
    assert generation_budget(tiny("rollout.max_new_tokens=8"), other, 5) == 8


def test_topd_rollouts_never_exceed_the_horizon():
    """POPD/TOPD property 4: in TOPD mode no training rollout has more than ⌊ρ·T_max⌋ tokens
    (a real embedded engine and reward workers); evaluation is not cut."""
    from mcore_rl.data.prompts import build_prompt_sets
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.pool import EmbeddedEnginePool
    from mcore_rl.runtime.rollout_manager import SALT_EVAL, RolloutManager, build_reward_runner
    from mcore_rl.runtime.rollouts import PoolBackend, Rollouts, scheduler_config

    cfg = tiny(
        "rollout.max_new_tokens=10",
        "rollout.context_length=64",
        "rollout.quantization=none",
        "distill.losses=[{name: topd}]",
        "distill.horizon.schedule=fixed",
        "distill.horizon.rho=0.35",
    )
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    pool = EmbeddedEnginePool.build(
        cfg.model, tok, num=1, quantization="none", max_running_requests=32, context_length=64, seed=0
    )
    prompts = build_prompt_sets(cfg, tok).train
    manager = RolloutManager(pool, prompts, build_reward_runner(cfg), cfg)
    rollouts = Rollouts(pool, PoolBackend(pool, prompts, manager.rewards, manager, cfg), scheduler_config(cfg))
    try:
        got = rollouts.next_batch(0, 0)  # the synchronous schedule's batch of step 0
        assert got is not None
        groups = got[0]
        lengths = [len(s.response_ids) for g in groups for s in g]
        assert len(lengths) == 16 and max(lengths) <= math.floor(0.35 * 10) == 3
        evals = manager.generate(prompts.take(4), 4, 1.0, SALT_EVAL)
        assert max(len(s.response_ids) for g in evals for s in g) > 3  # random weights rarely stop early
    finally:
        rollouts.close()
        manager.rewards.close()


# ------------------------------------------------------------------------------------ top-k log-probs


def test_topk_logprobs_and_their_gradients_against_log_softmax():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 5, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(13, 5, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randint(0, 13, (9,), generator=g)
    ids = torch.randint(0, 13, (9, 4), generator=g)

    def f(h, w):
        lp, ent, topk = vocab_parallel_topk_stats(h, w, y, ids, temperature=0.8, chunk_size=4)
        return lp, ent, topk

    assert torch.autograd.gradcheck(f, (hidden, weight))
    lp, _, topk = f(hidden, weight)
    logsm = ((hidden @ weight.t()) / 0.8).log_softmax(-1)
    torch.testing.assert_close(topk, logsm.gather(1, ids), rtol=0, atol=1e-12)
    torch.testing.assert_close(lp, logsm.gather(1, y[:, None]).squeeze(1), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------ TP=2 world

TOP_K = 8


def _teacher_logq(chunks) -> torch.Tensor:
    """log q over the vocabulary (see the module docstring), the same on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_rl.train.logprobs import output_weight, unwrap_gpt

    shard = output_weight(unwrap_gpt(chunks[0])).detach().float()
    parts = [torch.empty_like(shard) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, shard, group=ps.get_tensor_model_parallel_group())
    w = torch.cat(parts)  # [V, h]: only to build the teacher
    z = w @ torch.randn(w.shape[1], generator=torch.Generator().manual_seed(5))
    return torch.log_softmax(2.0 * z / z.std(), 0)


def _topk_world_check(rank: int, world: int) -> None:
    """The vocab-parallel top-k against the single-rank full-vocabulary result: values, hidden and
    weight gradients (TP group = the 2 ranks, each holding half of the vocabulary)."""
    import torch.distributed as dist

    from mcore_rl.train.logprobs import vocab_parallel_token_stats

    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(11, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(20, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 20, (11,), generator=g)
    ids = torch.randint(0, 20, (11, 5), generator=g)
    coef = torch.randn(3, 11, 5, generator=g, dtype=torch.float64)
    h_full, w_full = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent, topk = vocab_parallel_topk_stats(h_full, w_full, y, ids, temperature=0.9, chunk_size=4)
    ((coef[0, :, 0] * lp + coef[1, :, 0] * ent).sum() + (coef[2] * topk).sum()).backward()
    shard = slice(rank * 10, (rank + 1) * 10)
    h, w = hidden.clone().requires_grad_(), weight[shard].clone().requires_grad_()
    lp2, ent2, topk2 = vocab_parallel_topk_stats(h, w, y, ids, temperature=0.9, chunk_size=4, tp_group=dist.group.WORLD)
    ((coef[0, :, 0] * lp2 + coef[1, :, 0] * ent2).sum() + (coef[2] * topk2).sum()).backward()
    for a, b in ((lp2, lp), (ent2, ent), (topk2, topk)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-12)
    grad_h = h.grad.clone()
    dist.all_reduce(grad_h)  # each shard returns its partial sum (the region op adds them in a model)
    torch.testing.assert_close(grad_h, h_full.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, w_full.grad[shard], rtol=0, atol=1e-12)
    lp3, _ = vocab_parallel_token_stats(h.detach(), w.detach(), y, temperature=0.9, tp_group=dist.group.WORLD)
    torch.testing.assert_close(lp3, lp.detach(), rtol=0, atol=1e-12)


def _sample_batch(
    learner, prompts, vocab: int, length: int, gen: torch.Generator, log_q: torch.Tensor, teacher_ok=lambda i: True
) -> list[Sample]:
    """Responses sampled from the student itself (on-policy), token by token from its full
    distribution (the student's log-probs at all ids), scored by the teacher q."""
    all_ids = torch.arange(vocab)
    responses: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    for j in range(length):
        tmp = [Sample(p, p.index, r + [0], [0.0] * (j + 1), 0, "length") for p, r in zip(prompts, responses)]
        ids = all_ids.expand(len(prompts), j + 1, vocab)
        _, _, dist_lp = learner.token_stats(tmp, j + 1, topk_ids=ids, response_mask=torch.ones(len(prompts), j + 1))
        probs = dist_lp[:, j].exp()
        nxt = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen).squeeze(1)
        for i, y in enumerate(nxt.tolist()):
            responses[i].append(y)
            logps[i].append(float(dist_lp[i, j, y]))
    top = [log_q.topk(TOP_K).indices.tolist()] * length  # the teacher's top-k, most likely first
    out = []
    for i, (p, r, lp) in enumerate(zip(prompts, responses, logps)):
        teacher = (
            TeacherScores(
                logp=[float(log_q[y]) for y in r],
                topk_ids=[list(x) for x in top],
                topk_logp=[[float(log_q[v]) for v in x] for x in top],
                source="fixed q",
            )
            if teacher_ok(i)
            else TeacherScores(error="teacher down")
        )
        out.append(Sample(p, p.index, r, lp, 0, "length", reward=float(i % 2), teacher=teacher))
    return out


def _kl_to_teacher(learner, samples, vocab: int, log_q: torch.Tensor) -> float:
    """Mean over response positions of KL(π_θ(·|context) || q), from the full student distribution."""
    n, t = len(samples), len(samples[0].response_ids)
    _, _, lp = learner.token_stats(
        samples, t, topk_ids=torch.arange(vocab).expand(n, t, vocab), response_mask=torch.ones(n, t)
    )
    return float((lp.exp() * (lp - log_q)).sum(-1).mean())


def _learner_world(rank: int, world: int) -> None:
    from mcore_rl.config import validate_rl_config as validate
    from mcore_rl.data.prompts import PromptSource, task_pool
    from mcore_rl.models.shards import unwrap_model
    from mcore_rl.train.optimizer import build_optimizer
    from mcore_rl.train.policy import build_policy, build_reference_model, copy_weights
    from mcore_rl.train.rl_step import Learner

    _topk_world_check(rank, world)

    common = [
        "parallel.tensor_model_parallel_size=2",
        "optimizer.lr=1e-2",
        "algorithm.num_minibatches=1",
        "rollout.max_new_tokens=4",
        "algorithm.mismatch.name=none",
        f"distill.top_k={TOP_K}",
        f"teachers=[{{kind: frozen, top_k: {TOP_K}}}]",
    ]  # validation wants one; the samples carry hand-made scores
    cfg = tiny(*common, "distill.losses=[{name: reverse_kl, coef: 1.0}]", "distill.rl=false")
    policy = build_policy(cfg, validate, 100)
    vocab = cfg.model.vocab_size
    log_q = _teacher_logq(policy.chunks)
    initial = build_reference_model(cfg)
    copy_weights(initial, policy.chunks)
    learner = Learner(cfg, policy.chunks, policy.optimizer, None, policy.tokenizer.pad_id)
    prompts = PromptSource(task_pool("addition", 200, 0, 1), policy.tokenizer, seed=0)
    gen = torch.Generator().manual_seed(123)  # the same draws on both ranks (their log-probs agree)
    held_out = _sample_batch(learner, prompts.take(8), vocab, 4, gen, log_q)

    # the student's log-probs at the teacher's ids agree with its log-probs of the sampled tokens
    n, t = len(held_out), 4
    ids = torch.stack([torch.tensor([s.response_ids]).T.expand(t, 3) for s in held_out])  # [n, t, 3]
    lp, _, topk = learner.token_stats(held_out, t, topk_ids=ids, response_mask=torch.ones(n, t))
    torch.testing.assert_close(topk, lp[..., None].expand(n, t, 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(lp, torch.tensor([s.rollout_logp for s in held_out]), rtol=0, atol=1e-5)

    # prepare: the K1 advantage replaces the RL advantage (rl: false); a sample whose teacher failed
    # has no loss at all; with rl: true it keeps its RL advantage and only gets no distillation term
    batch = _sample_batch(learner, prompts.take(4), vocab, 4, gen, log_q, teacher_ok=lambda i: i != 1)
    per_seq, metrics = learner.prepare(batch, step=0)
    old = per_seq["old_logp"]
    teacher = torch.tensor([s.teacher.logp if s.teacher.error is None else [0.0] * 4 for s in batch])
    want = (teacher - old) * torch.tensor([[0.0 if i == 1 else 1.0] for i in range(4)])
    torch.testing.assert_close(per_seq["advantages"], want)
    assert per_seq["keep"][1].eq(0).all() and per_seq["keep"][[0, 2, 3]].eq(1).all()
    assert metrics["distill/scored_frac"] == 0.75 and "distill/reverse_kl/k1" in metrics
    rl_cfg = tiny(*common, "distill.losses=[{name: reverse_kl, coef: 0.5}]")
    rl_learner = Learner(rl_cfg, policy.chunks, policy.optimizer, None, policy.tokenizer.pad_id)
    per_seq_rl, _ = rl_learner.prepare(batch, step=0)
    from mcore_rl.algos.advantages import grpo

    rl_adv = grpo(torch.tensor([s.reward for s in batch]), torch.tensor([s.group for s in batch]))
    torch.testing.assert_close(per_seq_rl["advantages"], rl_adv[:, None] + 0.5 * want)
    assert per_seq_rl["keep"].eq(1).all()

    # 1. reverse-KL OPD alone (advantage phase): the KL to the teacher falls
    kl0 = _kl_to_teacher(learner, held_out, vocab, log_q)
    for step in range(6):
        records, _ = learner.train(_sample_batch(learner, prompts.take(16), vocab, 4, gen, log_q), step)
        assert all(r["train/skipped"] == 0.0 for r in records)
    kl1 = _kl_to_teacher(learner, held_out, vocab, log_q)
    assert kl1 < 0.9 * kl0, (kl0, kl1)

    # 2. the loss phase (forward KL over the teacher's top-k, student log-probs from the TP-sharded
    #    logits), from the same initial weights with a fresh optimizer
    for dst, src in zip(policy.chunks, initial):
        with torch.no_grad():
            for p_dst, p_src in zip(unwrap_model(dst).parameters(), src.parameters()):
                p_dst.copy_(p_src)
    assert abs(_kl_to_teacher(learner, held_out, vocab, log_q) - kl0) < 1e-6
    loss_cfg = tiny(*common, "distill.losses=[{name: test_topk_forward_kl, coef: 1.0}]", "distill.rl=false")
    opt = build_optimizer(policy.chunks, loss_cfg.optimizer, loss_cfg.train.precision, 100)
    kl_learner = Learner(loss_cfg, policy.chunks, opt, None, policy.tokenizer.pad_id)
    for step in range(4):
        records, batch_metrics = kl_learner.train(
            _sample_batch(kl_learner, prompts.take(16), vocab, 4, gen, log_q), step
        )
        assert all("distill/test_topk_forward_kl/loss" in r for r in records)
        assert "distill/test_topk_forward_kl/kl" in batch_metrics
    kl2 = _kl_to_teacher(kl_learner, held_out, vocab, log_q)
    assert kl2 < 0.9 * kl0, (kl0, kl2)
    if rank == 0:
        print(f"KL to the teacher: {kl0:.3f} -> reverse-KL OPD {kl1:.3f}; -> top-k forward KL {kl2:.3f}")


@pytest.mark.slow
def test_tp2_learner_distils_through_both_phases():
    run_world(2, _learner_world)


# ------------------------------------------------------------------------------------ EffOPD in the loop


def _effopd_world(rank: int, world: int, tmp: str, schedule: str) -> None:
    import json
    import os

    from mcore_rl.runtime import run_rl

    cfg = tiny(
        f"run_dir={tmp}/effopd",
        "train.num_steps=3",
        "eval.interval=0",
        "eval.at_start=false",
        "distill.effopd.enabled=true",
        "distill.effopd.validation_prompts=4",
        "distill.effopd.num_candidates=2",
        f"rollout.runtime={schedule}",
    )
    run_rl(cfg)
    with open(os.path.join(tmp, "effopd", "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    last = {r["rl_step"]: r for r in recs}  # the step's last record holds the step-level metrics
    version = 1  # the first sync
    for step in (1, 2, 3):
        r = last[step]
        if step == 3:  # 3 updates done: not a power of two
            assert "effopd/accepted" not in r
            version += 1
        else:
            k, scored = r["effopd/accepted"], r["effopd/candidates_scored"]
            assert r["effopd/coefficient"] == 2.0 * k and 0 <= k <= scored <= 2
            assert k == scored or scored == k + 1  # the search stops at the first candidate that drops
            version += 1 + int(scored) + 1  # W_step scored, each candidate, then the step's sync
        assert r["rollout/weight_version"] == version, (step, r["rollout/weight_version"], version)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sync", "async"])  # async: started engine processes, max_staleness 0
def test_effopd_extrapolates_in_the_loop_at_steps_one_and_two(tmp_path, schedule):
    run_world(1, _effopd_world, str(tmp_path), schedule)
