"""The vLLM backend against a real vLLM server process the pool starts (one for the module).

Skipped without the vLLM venv (`bash tools/setup_vllm.sh`; CI creates it and runs this tier).
The model is tiny and made here (head dim 32: vLLM's CPU attention takes no smaller one); its
reference is the same weights in `McoreRLForCausalLM`, the trainer's HF-side model, in fp32.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from mcore_rl.config.rl_schema import RolloutConfig
from mcore_rl.config.rl_vllm import vllm_python
from mcore_rl.config.schema import ModelConfig
from mcore_rl.data.tokenizer import ByteTokenizer
from mcore_rl.rollout.client import EngineHTTPError
from mcore_rl.rollout.engine_state import EngineState
from mcore_rl.rollout.pool import Generation, GenRequest, HTTPEnginePool, build_vllm_pool
from mcore_rl.rollout.weight_transports import SyncStats

pytestmark = pytest.mark.skipif(
    not os.path.isfile(vllm_python()),
    reason=f"no vLLM venv at {os.path.dirname(os.path.dirname(vllm_python()))} (bash tools/setup_vllm.sh)",
)

SEED = 11
MC = ModelConfig(
    vocab_size=384,
    hidden_size=64,
    ffn_hidden_size=128,
    num_layers=2,
    num_attention_heads=2,
    num_query_groups=1,
    max_position_embeddings=256,
)
PROMPTS = [[257, *b"12+34="], [257, *b"7+5="], [257, *b"99+1="]]


def reference(seed: int) -> torch.nn.Module:
    """The weights `write_vllm_model_dir` / `named_weights` make from `seed`, in the trainer's HF model."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return McoreRLForCausalLM(hf_config_from_model_config(MC)).float().eval()


def named_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.contiguous()) for k, v in reference(seed).state_dict().items()]


def ref_logprobs(model: torch.nn.Module, prompt: list[int], out: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPEnginePool]:
    root = tmp_path_factory.mktemp("vllm")
    rollout = RolloutConfig(
        engine_kind="vllm",
        num_embedded_engines=1,
        max_running_requests=8,
        context_length=256,
        sync_transport="disk",
        sync_dir=str(root / "weights"),
        health_check_interval_s=0.5,
        engine_startup_timeout_s=240.0,
        no_engine_timeout_s=240.0,
    )
    p = build_vllm_pool(rollout, MC, ByteTokenizer.default(), SEED, workdir=str(root / "engines"))
    p.test_rollout = rollout  # type: ignore[attr-defined]  # the tests' sync needs the config
    try:
        yield p
    finally:
        p.close()


def run(pool: HTTPEnginePool, req: GenRequest) -> Future[Generation]:
    return asyncio.run_coroutine_threadsafe(pool.agenerate(req), pool.loop)


def sync(pool: HTTPEnginePool, seed: int, version: int) -> float:
    transport = pool.weight_transport(pool.test_rollout)  # type: ignore[attr-defined]
    transport.pause_mode = "abort"  # type: ignore[attr-defined]
    start = time.perf_counter()
    transport.send([named_weights(seed)], version, SyncStats(version))
    return time.perf_counter() - start


def test_generation_logprobs_match_the_trainer_model_in_fp32(pool: HTTPEnginePool) -> None:
    ref = reference(SEED)
    for temperature in (1.0, 0.6):
        reqs = [
            GenRequest(p, {"temperature": temperature, "max_new_tokens": 8, "sampling_seed": i}, logprob_start_len=0)
            for i, p in enumerate(PROMPTS)
        ]
        for req, gen in zip(reqs, pool.generate(reqs)):
            assert gen.finish_reason in ("stop", "length") and gen.output_ids
            assert len(gen.output_logprobs) == len(gen.output_ids)
            assert gen.text == ByteTokenizer.default().decode(gen.output_ids, skip_special_tokens=True)
            want = ref_logprobs(ref, req.input_ids, gen.output_ids, temperature)
            assert max(abs(a - b) for a, b in zip(gen.output_logprobs, want)) < 1e-4
            assert gen.input_logprobs is not None and len(gen.input_logprobs) == len(req.input_ids) - 1
            prompt_ref = ref_logprobs(ref, req.input_ids[:1], req.input_ids[1:], 1.0)
            assert max(abs(a - b) for a, b in zip(gen.input_logprobs, prompt_ref)) < 1e-4
    # a sampling seed makes a sample reproducible; the eos id stops it and stays in the ids (as SGLang's)
    a, b = pool.generate([GenRequest(PROMPTS[0], {"temperature": 1.0, "max_new_tokens": 20, "sampling_seed": 5})] * 2)
    assert a.output_ids == b.output_ids
    with pytest.raises(EngineHTTPError, match="sampling_params.stop"):
        pool.generate([GenRequest(PROMPTS[0], {"max_new_tokens": 4, "stop": ["x"]})])


def test_weight_sync_by_disk_changes_output_and_the_original_restores_it(pool: HTTPEnginePool) -> None:
    greedy = [GenRequest(p, {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}) for p in PROMPTS]
    before = pool.generate(greedy)
    sync(pool, SEED + 1, 1)
    assert pool.weight_version == 1
    after = pool.generate(greedy)
    assert all(g.weight_version == 1 for g in after)
    assert [g.output_ids for g in after] != [g.output_ids for g in before]
    other = reference(SEED + 1)
    for req, gen in zip(greedy, after):
        want = ref_logprobs(other, req.input_ids, gen.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(gen.output_logprobs, want)) < 1e-4
    sync(pool, SEED, 2)
    restored = pool.generate(greedy)
    assert [g.output_ids for g in restored] == [g.output_ids for g in before]
    assert [g.output_logprobs for g in restored] == [g.output_logprobs for g in before]  # bit-identical
    assert pool.weight_version == 2


def test_pause_in_place_keeps_requests_abort_ends_them_retract_is_refused(pool: HTTPEnginePool) -> None:
    long = {"temperature": 1.0, "max_new_tokens": 160, "ignore_eos": True, "sampling_seed": 1}
    fut = run(pool, GenRequest(PROMPTS[0], long))
    _wait(lambda: _running(pool) > 0, "the request to start")
    pool.call("pause_generation", {"mode": "in_place"})
    time.sleep(0.5)  # paused: a request that were still running would finish in this time
    assert not fut.done()
    pool.call("continue_generation", {})
    gen = fut.result(timeout=120)
    assert gen.finish_reason == "length" and len(gen.output_ids) == 160

    fut = run(pool, GenRequest(PROMPTS[1], long))
    _wait(lambda: _running(pool) > 0, "the request to start")
    pool.call("pause_generation", {"mode": "abort"})
    gen = fut.result(timeout=60)
    pool.call("continue_generation", {})
    assert gen.finish_reason == "abort" and len(gen.output_ids) < 160
    assert len(gen.output_logprobs) == len(gen.output_ids)  # a partial rollout keeps its μ

    with pytest.raises(EngineHTTPError, match="retract"):
        pool.call("pause_generation", {"mode": "retract"})
    with pytest.raises(EngineHTTPError, match="sync_transport: disk"):
        pool.call("update_weights_from_tensor", {"serialized_named_tensors": []})


def test_sigkill_of_the_engine_costs_its_requests_not_the_run(pool: HTTPEnginePool) -> None:
    """Last in the module: the restarted engine serves again once a weight sync reached it."""
    from mcore_rl.rollout.router import NoHealthyEngine

    assert pool.processes is not None
    long = {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}
    futs = [run(pool, GenRequest(p, long)) for p in PROMPTS]
    _wait(lambda: _running(pool) > 0, "the requests to start")
    pid = pool.processes.pids[0]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for fut in futs:
        with pytest.raises(NoHealthyEngine):
            fut.result(timeout=60)
    url = pool.urls[0]
    _wait(lambda: pool.states.state(url) is EngineState.WAITING, "the restarted engine to answer", 240)
    sync(pool, SEED, 3)
    assert pool.states.state(url) is EngineState.SERVING
    gen = pool.generate([GenRequest(PROMPTS[0], {"temperature": 1.0, "max_new_tokens": 4})])[0]
    assert gen.weight_version == 3 and gen.output_ids


def _running(pool: HTTPEnginePool) -> int:
    """Requests the engine is running now (its Prometheus gauge)."""
    with urllib.request.urlopen(pool.urls[0] + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(
        sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
    )


def _wait(cond: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
