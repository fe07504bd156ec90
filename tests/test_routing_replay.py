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
import dataclasses

import numpy as np
import pytest
import torch

from mcore_rl.config.schema import ModelConfig, ParallelConfig
from tests.world import run_world

MOE = ModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_experts=4,
                  moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.01)


def _reference(mc: ModelConfig, seed: int = 1234):
    from mcore_rl.hf import Qwen3ReferenceForCausalLM, hf_config_from_model_config

    torch.manual_seed(seed)
    return Qwen3ReferenceForCausalLM(hf_config_from_model_config(mc)).float().eval()


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
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=5 + i, temperature=1.0, sampling_seed=i),
                    return_routed_experts=i != 1) for i, p in enumerate(prompts)]
    outs = _run(core, reqs)
    assert outs["r1"].routed_experts is None  # not asked for
    for i, p in enumerate(prompts):
        if i == 1:
            continue
        o = outs[f"r{i}"]
        seq = p + o.output_ids
        got = o.routed_experts
        assert isinstance(got, np.ndarray) and got.dtype == np.int32
        assert got.shape == (len(seq) - 1, MOE.num_layers, MOE.moe_router_topk)
        want, _ = reference_routing(model, seq)
        assert torch.equal(torch.from_numpy(got).long(), want[: len(seq) - 1]), i
        assert got.min() >= 0 and got.max() < MOE.num_experts

    # a retract (re-prefill of prompt + tokens so far) and a weight load while running (the K/V and
    # the routing of the prefix are recomputed under the new weights) end with the new weights' routing
    core = _engine(model, max_running_requests=4)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"s{i}", p, SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=i),
                                 return_routed_experts=True))
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
    dense = _reference(dataclasses.replace(MOE, arch="qwen3", num_experts=0))
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
            got = raw.reshape(len(seq) - 1, MOE.num_layers, MOE.moe_router_topk)  # slime's decoding
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
