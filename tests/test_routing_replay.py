"""MoE routing replay (R3 / R2): the engine's routed experts, and the trainer replaying them.

Engine side (one process): the embedded engine's `routed_experts` for a generation equal the
reference model's routing recomputed on the whole sequence, through continuous batching, a retract
and a weight load that makes the running requests recompute their K/V (the recomputed prefix's
routing replaces the old one: the new weights route differently), and over HTTP (SGLang's base64
int32 wire format, the server flag, the HTTP pool's decoding).

Trainer side (gloo worlds): in TP=2+SP, EP=2, PP=2 and TP=2 x EP=2 with ETP=1 the megatron-core routers replay
arbitrary expert ids exactly (recorded back from the routers), the replayed log-probs and the router
gradients equal those of the reference model forced to the same experts, natural routing equals the
reference's; the learner's R3 and R2 paths replay what they should.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig, ParallelConfig
from tests.world import run_world

MOE = ModelConfig.of(
    arch="qwen3_moe",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    moe_aux_loss_coeff=0.01,
)


def _reference(mc: ModelConfig, seed: int = 1234):
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    torch.manual_seed(seed)
    return McoreRLForCausalLM(hf_config_from_model_config(mc)).float().eval()


def _taps(model) -> list:
    return [layer.mlp.routing for layer in model.model.layers]


@torch.no_grad()
def reference_routing(model, ids: list[int], forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [len(ids), layers, k] the reference model uses on the whole sequence, its fp32
    log-probs of ids[1:]); with `forced` [len(ids), layers, k] the experts are those (rows of -1: natural)."""
    taps = _taps(model)
    for li, tap in enumerate(taps):
        tap.record, tap.forced = True, None if forced is None else forced[:, li]
    try:
        logits = model(torch.tensor([ids])).logits[0].float()
        routed = torch.stack([tap.routed for tap in taps], dim=1)
    finally:
        for tap in taps:
            tap.record, tap.forced, tap.routed = False, None, None
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return routed, lp


# ------------------------------------------------------------------------------------ engine


def _engine(model, **kw):
    import copy

    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.engine.core import EngineCore

    return EngineCore(copy.deepcopy(model), load_tokenizer(None), context_length=128, **kw)


def _run(core, reqs) -> dict:
    for r in reqs:
        core.add_request(r)
    outs = {}
    while core.has_work():
        outs.update({o.rid: o for o in core.step() if o.finished})
    return outs


def test_engine_routed_experts_are_the_reference_routing_of_the_sequence():
    from mcore_rl.rollout.engine.core import Request
    from mcore_rl.rollout.engine.sampling import SamplingParams

    model = _reference(MOE)
    core = _engine(model, max_running_requests=3)
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 6, 5)]  # 4 requests, 3 slots: one waits
    reqs = [
        Request(
            f"r{i}",
            p,
            SamplingParams(max_new_tokens=5 + i, temperature=1.0, sampling_seed=i),
            return_routed_experts=i != 1,
        )
        for i, p in enumerate(prompts)
    ]
    outs = _run(core, reqs)
    assert outs["r1"].routed_experts is None  # not asked for
    for i, p in enumerate(prompts):
        if i == 1:
            continue
        o = outs[f"r{i}"]
        seq = p + o.output_ids
        got = o.routed_experts
        assert isinstance(got, np.ndarray) and got.dtype == np.int32
        assert got.shape == (len(seq) - 1, MOE.num_layers, MOE.section(MoEKeys).moe_router_topk)
        want, _ = reference_routing(model, seq)
        assert torch.equal(torch.from_numpy(got).long(), want[: len(seq) - 1]), i
        assert got.min() >= 0 and got.max() < MOE.section(MoEKeys).num_experts

    # a retract (re-prefill of prompt + tokens so far) and a weight load while running (the K/V and
    # the routing of the prefix are recomputed under the new weights) end with the new weights' routing
    core = _engine(model, max_running_requests=4)
    for i, p in enumerate(prompts):
        core.add_request(
            Request(
                f"s{i}",
                p,
                SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=i),
                return_routed_experts=True,
            )
        )
    outs = {}
    for _ in range(3):
        outs.update({o.rid: o for o in core.step() if o.finished})
    assert core.retract() == 4
    for _ in range(3):
        outs.update({o.rid: o for o in core.step() if o.finished})
    new = _reference(MOE, seed=99)  # other router weights: other experts for most tokens
    gates = {n: t for n, t in new.state_dict().items() if n.endswith("mlp.gate.weight")}
    before = core.recomputed_tokens
    core.load_weights(gates.items())
    while core.has_work():
        outs.update({o.rid: o for o in core.step() if o.finished})
    assert core.recomputed_tokens > before
    mixed = _reference(MOE)
    mixed.load_state_dict(gates, strict=False)
    changed = 0
    for i, p in enumerate(prompts):
        o = outs[f"s{i}"]
        seq = p + o.output_ids
        want, _ = reference_routing(mixed, seq)
        old, _ = reference_routing(model, seq)
        assert torch.equal(torch.from_numpy(o.routed_experts).long(), want[:-1]), i
        changed += int(not torch.equal(old[:-1], want[:-1]))
    assert changed, "the new router weights should route some sequence differently"

    # a dense model has no experts to return
    dense = _reference(MOE.replace(arch="qwen3", num_experts=0))
    with pytest.raises(ValueError, match="return_routed_experts"):
        _engine(dense).add_request(Request("d", [3, 4], return_routed_experts=True))


def test_routed_experts_over_http_and_both_pools():
    import aiohttp  # noqa: F401 - the server and client need it

    from mcore_rl.rollout.client import EngineClient
    from mcore_rl.rollout.engine.driver import EngineDriver
    from mcore_rl.rollout.launch_flags import parse_server_args
    from mcore_rl.rollout.pool import EmbeddedEnginePool, GenRequest, HTTPEnginePool
    from mcore_rl.rollout.protocol import decode_routed_experts, encode_routed_experts
    from mcore_rl.rollout.server import EngineServer, ServerThread

    a = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2) - 1
    assert np.array_equal(decode_routed_experts(encode_routed_experts(a), 3, 3), a)
    assert base64.b64decode(encode_routed_experts(a))[:4] == (-1).to_bytes(4, "little", signed=True)
    with pytest.raises(ValueError, match="routed_experts"):
        decode_routed_experts(encode_routed_experts(a), 4, 3)

    model = _reference(MOE)
    prompt = list(range(5, 12))
    sp = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3}
    for enabled in (False, True):
        args = parse_server_args(["--enable-return-routed-experts"] if enabled else [])
        assert args.enable_return_routed_experts is enabled
        with ServerThread(EngineServer(EngineDriver(_engine(model)), args)) as srv:
            import asyncio

            async def call():
                async with EngineClient(srv.url) as c:
                    return await c.generate(input_ids=prompt, sampling_params=sp, return_routed_experts=True)

            if not enabled:
                with pytest.raises(Exception, match="return_routed_experts.*--enable-return-routed-experts") as err:
                    asyncio.run(call())
                assert "400" in str(err.value) or getattr(err.value, "status", 400) == 400
                continue
            out = asyncio.run(call())
            seq = prompt + out["output_ids"]
            raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
            got = raw.reshape(len(seq) - 1, MOE.num_layers, MOE.section(MoEKeys).moe_router_topk)  # slime's decoding
            want, _ = reference_routing(model, seq)
            assert torch.equal(torch.from_numpy(got.copy()).long(), want[:-1])
            pool = HTTPEnginePool([srv.url], num_layers=MOE.num_layers)
            try:
                g = pool.generate([GenRequest(prompt, sp, return_routed_experts=True), GenRequest(prompt, sp)])
            finally:
                pool.close()
            assert g[0].output_ids == out["output_ids"] and np.array_equal(g[0].routed_experts, got)
            assert g[1].routed_experts is None
    emb = EmbeddedEnginePool([_engine(model)]).generate([GenRequest(prompt, sp, return_routed_experts=True)])[0]
    assert emb.output_ids == out["output_ids"] and np.array_equal(emb.routed_experts, got)


# ------------------------------------------------------------------------------------ trainer

SEQ, MBS = 24, 2
NO_AUX = MOE.replace(moe_aux_loss_coeff=0.0)  # gradients compared exactly: no aux term


def _samples(vocab: int, count: int = 7, seed: int = 3) -> list:
    """Random prompts and responses (the same on every rank), each shorter than a row."""
    from mcore_rl.data.samples import Prompt, Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        p = torch.randint(3, vocab, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(Prompt(index=i, text="", ids=p), i // 2, r, [-1.0] * len(r), 0, "stop"))
    return out


def _forced(samples, mc: ModelConfig, seed: int = 11) -> list[torch.Tensor]:
    """Arbitrary (not the natural) experts for every forwarded token: [n - 1, layers, k], distinct per row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids)
        ids = torch.rand(n - 1, mc.num_layers, mc.section(MoEKeys).num_experts, generator=g).argsort(-1)[
            ..., : mc.section(MoEKeys).moe_router_topk
        ]
        out.append(ids.to(torch.int16))
    return out


def _pad_last(r: torch.Tensor) -> torch.Tensor:
    return torch.cat([r.long(), torch.full((1, *r.shape[1:]), -1, dtype=torch.long)])


def _logprobs(chunks, samples, routing, num_positions: int) -> torch.Tensor:
    """[N, T] response log-probs as the learner's `token_stats` computes them (with `routing`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_rl.train.logprobs import compute_token_stats
    from mcore_rl.train.packing import build_microbatches
    from mcore_rl.train.rl_step import MODEL_KEYS

    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mbs = build_microbatches(samples, range(len(samples)), SEQ, MBS, dp_rank, dp, 0, num_positions, routing=routing)
    stats = compute_token_stats(chunks, [{k: v for k, v in mb.items() if k in MODEL_KEYS} for mb in mbs])
    full = torch.zeros(len(samples), num_positions)
    for mb, st in zip(mbs, stats):
        if mb["seq_index"].numel():
            full[mb["seq_index"]] = st.logprobs.reshape(-1)[mb["seq_pos"]]
    if dp > 1:
        dist.all_reduce(full, group=ps.get_data_parallel_group())
    return full


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal routing; a sample's last token may be -1 (cut off by the row end: it is no model input)."""
    return torch.equal(got[:-1].long(), want[:-1]) and (
        torch.equal(got[-1].long(), want[-1]) or bool((got[-1] == -1).all())
    )


def _layout(mc: ModelConfig, pc: ParallelConfig, ref, samples, forced, expect) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.hf.weight_map import hf_to_megatron
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.models.shards import gather_full_state_dict, load_full_state_dict
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train import routing_replay as rr
    from mcore_rl.train.forward_backward import forward_backward, prepare_config, wrap_ddp
    from mcore_rl.train.logprobs import make_forward_step
    from mcore_rl.train.packing import build_microbatches

    name = str(pc)
    init_model_parallel(pc)
    set_seed(1)
    config = transformer_config(mc, pc)
    chunks = build_model(mc, pc, config=config)
    load_full_state_dict(chunks, hf_to_megatron(ref.state_dict(), mc))
    chunks = wrap_ddp(chunks, config)
    prepare_config(config, chunks)
    taps = rr.attach(chunks)
    assert taps and all(
        isinstance(c.module.decoder.layers[0].mlp.router.router_replay, rr.ReplayRouting) for c in chunks
    )
    T = max(len(s.response_ids) for s in samples)
    order = range(len(samples))
    mask = torch.zeros(len(samples), T)
    for i, s in enumerate(samples):
        mask[i, : len(s.response_ids)] = 1

    # natural routing: what the reference model picks
    with rr.recording(taps):
        lp = _logprobs(chunks, samples, None, T)
    natural = rr.gather_recorded(taps, samples, order, SEQ, MBS, mc.num_layers, mc.section(MoEKeys).moe_router_topk)
    for i in order:
        assert _same(natural[i], expect["natural"][i]), f"{name}: natural routing of sample {i}"
    torch.testing.assert_close(lp * mask, expect["natural_lp"] * mask, rtol=1e-5, atol=1e-5)

    # replay: the routers use exactly the forced experts (the last token of a sample routes naturally),
    # and compute what the reference model computes with those experts
    with rr.recording(taps):
        lp = _logprobs(chunks, samples, forced, T)
    used = rr.gather_recorded(taps, samples, order, SEQ, MBS, mc.num_layers, mc.section(MoEKeys).moe_router_topk)
    for i in order:
        assert torch.equal(used[i][:-1].long(), forced[i].long()), f"{name}: replayed routing of sample {i}"
        assert _same(used[i], expect["forced_routing"][i]), f"{name}: sample {i}'s last token"
    torch.testing.assert_close(lp * mask, expect["forced_lp"] * mask, rtol=1e-5, atol=1e-5)
    assert float(((lp - expect["natural_lp"]).abs() * mask).max()) > 1e-3, f"{name}: replay changed nothing"

    # training forward under replay: the router weights get the reference's gradients
    def loss_fn(batch, stats):
        m = batch["loss_mask"].float()
        loss = -(stats.logprobs * m).sum()
        return loss, m.sum().to(torch.int), {"lm_loss": torch.stack([loss.detach(), m.sum()])}

    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mbs = build_microbatches(samples, order, SEQ, MBS, dp_rank, dp, 0, T, routing=forced)
    for c in chunks:
        c.train()
    forward_backward(chunks, mbs, forward_step=make_forward_step(loss_fn, with_entropy=False))
    grads = gather_full_state_dict(chunks, grads=True)
    want = hf_to_megatron(expect["forced_grads"], mc)
    routers = [k for k in want if "router.weight" in k]
    assert routers
    for key in routers + [k for k in want if "experts" in k][:2]:
        scale = float(want[key].abs().max())
        assert scale > 0, key
        torch.testing.assert_close(
            grads[key], want[key], rtol=1e-4, atol=2e-6 * scale, msg=lambda m: f"{name} {key}: {m}"
        )
    rr.clear(taps)
    ps.destroy_model_parallel()


def _expectations(mc: ModelConfig, ref, samples, forced) -> dict:
    natural, routing = [], []
    T = max(len(s.response_ids) for s in samples)
    nat_lp = torch.zeros(len(samples), T)
    f_lp = torch.zeros(len(samples), T)
    ref.zero_grad()
    total = sum(len(s.response_ids) for s in samples)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        r, lp = reference_routing(ref, seq)
        natural.append(r)
        nat_lp[i, : len(s.response_ids)] = lp[len(s.prompt_ids) - 1 :]
        r, lp = reference_routing(ref, seq, _pad_last(forced[i]))
        routing.append(r)
        f_lp[i, : len(s.response_ids)] = lp[len(s.prompt_ids) - 1 :]
        # the gradient of -sum log p over the response tokens / all response tokens, forced experts
        taps = _taps(ref)
        for li, tap in enumerate(taps):
            tap.forced = _pad_last(forced[i])[:, li]
        logits = ref(torch.tensor([seq])).logits[0].float()
        for tap in taps:
            tap.forced = None
        lps = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        (-(lps[len(s.prompt_ids) - 1 :].sum()) / total).backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    return dict(natural=natural, natural_lp=nat_lp, forced_routing=routing, forced_lp=f_lp, forced_grads=grads)


def _layouts_world(rank: int, world_size: int, layouts: list[ParallelConfig]) -> None:
    mc = NO_AUX
    ref = _reference(mc)
    samples = _samples(mc.vocab_size)
    forced = _forced(samples, mc)
    expect = _expectations(mc, ref, samples, forced)
    for pc in layouts:
        _layout(mc, pc, ref, samples, forced, expect)


def P(**kw) -> ParallelConfig:
    names = dict(
        tp="tensor_model_parallel_size",
        pp="pipeline_model_parallel_size",
        ep="expert_model_parallel_size",
        sp="sequence_parallel",
        etp="expert_tensor_parallel_size",
    )
    return ParallelConfig(**{names[k]: v for k, v in kw.items()})


@pytest.mark.slow
def test_replay_in_megatron_routers_two_rank_layouts():
    run_world(2, _layouts_world, [P(tp=2, sp=True), P(ep=2), P(pp=2)])


@pytest.mark.slow
def test_replay_in_megatron_routers_expert_tensor_parallel():
    """TP=2 x EP=2 with sequence parallelism and ETP=1 (experts not split over TP)."""
    run_world(4, _layouts_world, [P(tp=2, ep=2, sp=True, etp=1)])


# ------------------------------------------------------------------------------------ learner

LEARNER = [
    "model.arch=qwen3_moe",
    "model.num_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_aux_loss_coeff=0.01",
    "init.sft_steps=0",
    "parallel.expert_model_parallel_size=2",
]


def test_config_rejects_replay_without_experts_or_with_full_recompute():
    from mcore_rl.config import validate_rl_config
    from mcore_rl.config.errors import ConfigError
    from tests.helpers import tiny

    with pytest.raises(ConfigError, match="algorithm.routing_replay.*dense"):
        validate_rl_config(tiny("algorithm.routing_replay=r3"), 1)
    with pytest.raises(ConfigError, match="algorithm.routing_replay.*recompute=full"):
        validate_rl_config(tiny(*LEARNER[:-1], "algorithm.routing_replay=r2", "train.recompute=full"), 1)
    validate_rl_config(tiny(*LEARNER[:-1], "algorithm.routing_replay=r3"), 1)
    with pytest.raises(ConfigError, match="algorithm.routing_replay"):
        tiny("algorithm.routing_replay=r1")


def _learner_world(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from mcore_rl.config import validate_rl_config
    from mcore_rl.train import routing_replay as rr
    from mcore_rl.train.forward_backward import forward_backward
    from mcore_rl.train.logprobs import make_forward_step
    from mcore_rl.train.packing import build_microbatches, split_minibatches
    from mcore_rl.train.policy import build_policy
    from mcore_rl.train.rl_step import Learner
    from tests.helpers import tiny

    cfg = tiny(*LEARNER, "algorithm.routing_replay=r2")
    policy = build_policy(cfg, validate_rl_config, total_iters=8)
    assert ps.get_data_parallel_world_size() == 2 and ps.get_expert_model_parallel_world_size() == 2
    pad, t, mc = policy.tokenizer.pad_id, cfg.train, cfg.model
    samples = _samples(mc.vocab_size, count=8)

    # R2: π_old's own routing, recorded, is what every training forward replays
    learner = Learner(cfg, policy.chunks, policy.optimizer, None, pad)
    per_seq, _ = learner.prepare(samples)
    routing = learner.routing
    assert [tuple(r.shape) for r in routing] == [(len(s.prompt_ids) + len(s.response_ids), 2, 2) for s in samples]
    assert all(bool((r[:-1] >= 0).all()) for r in routing)
    T = per_seq["old_logp"].shape[1]
    router_params = [p for c in policy.chunks for n, p in c.module.named_parameters() if n.endswith("router.weight")]
    assert router_params
    for step, part in enumerate(split_minibatches(len(samples), 2, t.seed, 0, 0)):
        mbs = build_microbatches(
            samples,
            part,
            t.seq_length,
            t.micro_batch_size,
            ps.get_data_parallel_rank(),
            2,
            pad,
            T,
            per_seq,
            routing=routing,
        )
        clear_aux_losses_tracker()
        for c in policy.chunks:
            c.train()
        with rr.recording(learner.replay_taps):
            forward_backward(
                policy.chunks, mbs, forward_step=make_forward_step(learner.loss_fn, cfg.rollout.temperature)
            )
        used = rr.gather_recorded(learner.replay_taps, samples, part, t.seq_length, t.micro_batch_size, 2, 2)
        for i in part:
            assert torch.equal(used[i], routing[i]), f"R2 step {step}: sample {i} not routed as in π_old"
        # gradients still reach the router weights, and the load-balancing loss is defined
        for p in router_params:
            g = p.main_grad
            assert bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0
        aux = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
        assert bool(torch.isfinite(aux).all()) and bool((aux > 0).all()), aux
        policy.optimizer.step()
    records, _ = learner.train(samples, 0)
    assert records and all(np.isfinite(r["train/loss"]) for r in records)
    assert all(tap.target is None for tap in learner.replay_taps)  # nothing left for a later forward

    # R3: the engine's experts (here arbitrary ones) in the π_old recompute
    cfg3 = tiny(*LEARNER, "algorithm.routing_replay=r3")
    learner = Learner(cfg3, policy.chunks, policy.optimizer, None, pad)
    forced = _forced(samples, mc)
    for s, r in zip(samples, forced):
        s.routed_experts = r
    with rr.recording(learner.replay_taps):
        learner.prepare(samples)
    used = rr.gather_recorded(learner.replay_taps, samples, range(len(samples)), t.seq_length, t.micro_batch_size, 2, 2)
    for i in range(len(samples)):
        assert torch.equal(used[i][:-1], forced[i].int()), f"R3: sample {i}"
    records, _ = learner.train(samples, 1)
    assert all(np.isfinite(r["train/loss"]) for r in records)
    samples[2].routed_experts = forced[2][:, :1]
    with pytest.raises(ValueError, match=r"sample 2 .*shape \(\d+, 1, 2\), expected \(\d+, 2, 2\)"):
        learner.prepare(samples)
    samples[2].routed_experts = None
    with pytest.raises(ValueError, match="sample 2 .*no routed_experts"):
        learner.prepare(samples)


@pytest.mark.slow
def test_learner_replays_r2_and_r3():
    run_world(2, _learner_world)


# ------------------------------------------------------------------------------------ measurement


def test_fp8_engine_mismatch_with_and_without_replay():
    """The measurement of docs/mismatch_correction.md ("MoE routing replay"), small: both finite."""
    import importlib.util
    import os

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "routing_replay_report.py"
    )
    spec = importlib.util.spec_from_file_location("routing_replay_report", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    m = tool.measure(prompts=4, samples=2, max_new_tokens=12)
    print(m)
    for key in ("k3_no_replay", "abs_logp_diff_no_replay", "k3_r3", "abs_logp_diff_r3", "routing_differs_frac"):
        assert np.isfinite(m[key]) and m[key] >= 0, key
    assert m["k3_no_replay"] > 0 and m["response_tokens"] > 0


def test_partial_rollouts_keep_the_latest_responses_routing():
    """A request continued as prompt + tokens so far: the sample's routing is the last response's,
    which covers the whole sequence (the engine prefilled all of it again)."""
    from mcore_rl.runtime.scheduler import RolloutScheduler, SchedulerConfig
    from mcore_rl.runtime.simulation import SimBackend, SimulatedEngines, run_simulated, simulate_learner

    class Routed(SimBackend):
        async def generate(self, request):
            g = await super().generate(request)
            n = len(request.input_ids) + len(g.output_ids) - 1
            g.routed_experts = np.full((n, 1, 2), len(request.input_ids), dtype=np.int32)  # names the request
            return g

    async def go():
        eng = SimulatedEngines(2, 16, lambda batch: 0.01 * (1 + batch / 16))
        sch = RolloutScheduler(
            Routed(eng, base_tokens=16), SchedulerConfig(group_size=4, batch_groups=4, max_staleness=2)
        )
        run = await simulate_learner(sch, eng, 8, lambda g: 1.0, sync_time=0.05, keep_batches=True)
        return run, sch

    run, sch = run_simulated(go())
    samples = [s for groups in run.batches for g in groups for s in g]
    assert sch.ledger.continued > 0
    continued = 0
    for s in samples:
        r = s.routed_experts
        assert isinstance(r, torch.Tensor) and r.dtype == torch.int16
        assert tuple(r.shape) == (len(s.prompt_ids) + len(s.response_ids) - 1, 1, 2)
        assert len(set(r.flatten().tolist())) == 1  # one response's routing for the whole sequence
        continued += int(int(r[0, 0, 0]) > len(s.prompt_ids))  # ... the continuation's, not the first part's
    assert continued > 0, "no sample in the batches was continued across a sync"
