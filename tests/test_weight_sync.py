"""Trainer -> engine weight sync: wire formats, the engine-side receiver behind the real HTTP
server, gathering megatron-core shards in every layout, and end-to-end syncs from a TP=2 trainer to
`mcore-rl serve` engines in other processes over each transport (engine log-probs equal the
trainer's in fp32; an FP8 engine differs by a measured K3).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pickle
from dataclasses import dataclass, field

import pytest
import torch

from tests.helpers import P
from mcore_rl.config.schema import ModelConfig
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
from mcore_rl.rollout import weight_receiver as rx
from mcore_rl.rollout.engine.driver import EngineDriver
from mcore_rl.rollout.client import EngineClient, EngineHTTPError
from mcore_rl.rollout.engine.core import EngineCore
from mcore_rl.rollout.engine.fp8 import FP8_DTYPE, quantize_block_fp8
from mcore_rl.rollout.server import EngineServer, ServerThread
from mcore_rl.rollout.weight_protocol import (
    BucketMeta,
    WeightChecksum,
    decode_tensor_payload,
    encode_named_tensors,
    encode_named_tensors_sglang,
    encode_tensor_file,
    flatten,
    tensor_digest,
    unflatten,
)
from mcore_rl.rollout.pool import HTTPEnginePool
from mcore_rl.rollout.weight_transports import (
    DiskTransport,
    DistributedTransport,
    InProcessTransport,
    SyncStats,
    TensorTransport,
)
from mcore_rl.train.weight_sync import WeightSync, WeightSyncError, iter_buckets, quantize_for_fp8_engine
from tests.world import run_world

TOK = load_tokenizer(None)
IDS = TOK.encode("the weights of the trainer, now in the engine")


def k3(d: torch.Tensor) -> float:
    """Mean per-token K3 estimator of KL, d = logp_trainer - logp_engine."""
    return float((torch.exp(d) - d - 1).mean())


def reference_model(seed: int, mc: ModelConfig = ModelConfig()) -> McoreRLForCausalLM:
    torch.manual_seed(seed)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).eval()
    with torch.no_grad():  # peaked distributions, so that different weights give different log-probs
        for p in model.parameters():
            p.mul_(8.0) if p.ndim == 2 else p.add_(0.3 * torch.randn_like(p))
    return model


def ref_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def request(url: str, method: str, **fields):
    """One `EngineClient` call from synchronous test code."""

    async def once():
        async with EngineClient(url, retries=0) as client:
            return await getattr(client, method)(**fields)

    return asyncio.run(once())


def engine_logprobs(url: str, ids: list[int]) -> torch.Tensor:
    """Prompt scoring through /generate: log p(ids[t] | ids[:t]) for t >= 1."""
    out = request(
        url,
        "generate",
        input_ids=list(ids),
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])


def weight_version(url: str) -> str:
    return request(url, "get_model_info")["weight_version"]


def start_server(core: EngineCore) -> ServerThread:
    server = ServerThread(EngineServer(EngineDriver(core)))
    server.start()
    return server


def _server_main(urls, stop, engines: list[dict]) -> None:
    """`mcore-rl serve`-style servers (the demo model), one per entry of `engines`, until `stop` is set."""
    torch.set_num_threads(1)
    servers = [start_server(EngineCore.from_model_path(None, context_length=128, **kw)) for kw in engines]
    urls.put([s.url for s in servers])
    stop.wait()
    for s in servers:
        s.stop()


class ServerProcess:
    """Engine servers in another process: one (`ServerProcess(**engine_kw)`) or several sharing the
    process's start-up cost (`ServerProcess(engines=[{}, {"quantization": "fp8"}])`, `.urls`)."""

    def __init__(self, engines: list[dict] | None = None, **engine_kw) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        urls, self.stop = ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=_server_main, args=(urls, self.stop, engines or [engine_kw]), daemon=True)
        self.proc.start()
        self.urls: list[str] = urls.get(timeout=300)
        self.url = self.urls[0]

    def close(self) -> None:
        self.stop.set()
        self.proc.join(30)


# --------------------------------------------------------------------------------------------
# wire formats
# --------------------------------------------------------------------------------------------


def test_flattened_bucket_round_trip_mixed_dtypes():
    named = [
        ("a", torch.randn(3).bfloat16()),  # 6 bytes: the next tensor starts unaligned
        ("b", torch.randn(2, 5)),
        ("c", torch.randn(4, 4).to(FP8_DTYPE)),
        ("d", torch.randn(7).half()),
        ("e", torch.randn(3, 2).t()),  # not contiguous
    ]
    meta = BucketMeta.of(named)
    flat = flatten(named)
    assert flat.dtype == torch.uint8 and flat.numel() == meta.total_bytes
    back = unflatten(flat, meta.names, [t.dtype for _, t in named], meta.shapes)
    for (n, t), (m, u) in zip(named, back):
        assert n == m and u.dtype == t.dtype and torch.equal(u.view(torch.uint8), t.contiguous().view(torch.uint8))
    assert meta.dtypes == ["bfloat16", "float32", "float8_e4m3fn", "float16", "float32"]
    with pytest.raises(ValueError, match="metadata describes"):
        unflatten(flat[:-1], meta.names, [t.dtype for _, t in named], meta.shapes)


def test_buckets_keep_order_and_size():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(iter_buckets(named, bucket_bytes=25 * 4))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(named, 0))


def test_safetensors_files_and_tensor_payloads(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mcore_rl.rollout.weight_protocol import read_safetensors_header, write_safetensors

    named = [
        ("x", torch.randn(2, 3)),
        ("odd", torch.randn(3).bfloat16()),
        ("y", torch.randn(4).to(FP8_DTYPE)),
        ("t", torch.randn(3, 2).t()),
    ]

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    # files: ours open with the safetensors library, and the library's with our reader
    write_safetensors(named, tmp_path / "ours.safetensors")
    with safe_open(tmp_path / "ours.safetensors", "pt") as f:
        assert all(same(f.get_tensor(n), t) for n, t in named)
    save_file({n: t.contiguous() for n, t in named}, tmp_path / "lib.safetensors")
    with open(tmp_path / "lib.safetensors", "rb") as f:
        entries = {e.name: e for e in read_safetensors_header(f)}
    data = (tmp_path / "lib.safetensors").read_bytes()
    for n, t in named:
        e = entries[n]
        assert same(
            torch.frombuffer(bytearray(data[e.begin : e.end]), dtype=torch.uint8).view(e.dtype).reshape(e.shape), t
        )
    # /update_weights_from_tensor payloads: safetensors in base64; pickles are refused
    back, path = decode_tensor_payload(encode_named_tensors(named), "f")
    assert path is None and [n for n, _ in back] == [n for n, _ in named]
    assert all(same(a, b) for (_, a), (_, b) in zip(named, back))
    with pytest.raises(ValueError, match=r"^f: a pickle \(SGLang's MultiprocessingSerializer format\)"):
        decode_tensor_payload(encode_named_tensors_sglang(named), "f")  # what a real SGLang server takes
    with pytest.raises(ValueError, match=r"^f: a pickle"):
        decode_tensor_payload(base64.b64encode(pickle.dumps(("x", 1))).decode(), "f")
    assert decode_tensor_payload(encode_tensor_file("/dev/shm/x.safetensors"), "f") == ([], "/dev/shm/x.safetensors")
    with pytest.raises(ValueError, match=r"^f: not a safetensors payload"):
        decode_tensor_payload("%%%", "f")
    with pytest.raises(ValueError, match=r"^f: not valid base64"):
        decode_tensor_payload("é", "f")
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buf)
    with pytest.raises(ValueError, match=r"^f: not a safetensors payload"):
        decode_tensor_payload(base64.b64encode(buf.getvalue()).decode(), "f")
    with pytest.raises(ValueError, match=r"^f: expected a base64 string"):
        decode_tensor_payload(123, "f")


def test_fp8_quantization_during_sync_covers_exactly_the_engines_fp8_layers():
    sd = reference_model(0).state_dict()
    out = dict(quantize_for_fp8_engine(sd.items()))
    engine = EngineCore(reference_model(1), TOK, quantization="fp8")
    assert set(out) == set(engine.model.state_dict())  # same names as the FP8 engine holds
    for name, t in sd.items():
        module = name.removesuffix(".weight")
        if module in engine.fp8_layers:
            q, s = quantize_block_fp8(t)
            assert out[name].dtype == FP8_DTYPE and torch.equal(out[name].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(out[module + ".weight_scale_inv"], s)
        else:
            assert out[name] is t


# --------------------------------------------------------------------------------------------
# engine side: the receiver behind the HTTP server (one process)
# --------------------------------------------------------------------------------------------


def test_tensor_disk_and_in_process_transports(tmp_path):
    core = EngineCore(reference_model(0), TOK, context_length=128)
    server = start_server(core)
    url = server.url
    pool = HTTPEnginePool([url])
    try:
        sources = {v: reference_model(10 + v) for v in (1, 2, 3, 4, 5)}
        expected = {v: ref_logprobs(m, IDS) for v, m in sources.items()}
        assert (engine_logprobs(url, IDS) - expected[1]).abs().max() > 0.1  # other weights to start with

        stats = SyncStats(4)
        TensorTransport(pool, payload="inline").send(iter_buckets(sources[5].state_dict().items(), 1 << 16), 4, stats)
        assert stats.buckets > 1 and weight_version(url) == "4"
        torch.testing.assert_close(engine_logprobs(url, IDS), expected[5], atol=1e-5, rtol=0)

        shm = tmp_path / "shm"
        shm.mkdir()
        tensors = TensorTransport(pool, shm_dir=str(shm))
        tensors.send(iter_buckets(sources[1].state_dict().items(), 1 << 16), 5, stats)
        assert weight_version(url) == "5" and len(list(shm.iterdir())) == 2  # two alternating files
        torch.testing.assert_close(engine_logprobs(url, IDS), expected[1], atol=1e-5, rtol=0)
        tensors.close()
        assert not list(shm.iterdir())

        disk = DiskTransport(pool, str(tmp_path / "disk"))
        disk.send(iter_buckets(sources[2].state_dict().items(), 1 << 16), 6, SyncStats(6))
        assert weight_version(url) == "6"
        torch.testing.assert_close(engine_logprobs(url, IDS), expected[2], atol=1e-5, rtol=0)
        disk.send(iter_buckets(sources[3].state_dict().items(), 1 << 17), 7, SyncStats(7))  # fewer shards
        shards = sorted(p.name for p in (tmp_path / "disk").glob("*.safetensors"))
        index = json.loads((tmp_path / "disk" / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(shards) > 1 and set(index.values()) == set(shards)  # the stale extra shards are gone
        torch.testing.assert_close(engine_logprobs(url, IDS), expected[3], atol=1e-5, rtol=0)

        InProcessTransport([core]).send(iter_buckets(sources[4].state_dict().items(), 1 << 16), 8, SyncStats(8))
        assert weight_version(url) == "8"
        torch.testing.assert_close(engine_logprobs(url, IDS), expected[4], atol=1e-5, rtol=0)

        # SGLang's version rules: a bucket without weight_version leaves it, a whole checkpoint +1
        half = list(sources[1].state_dict().items())[:4]
        request(url, "update_weights_from_tensor", serialized_named_tensors=[encode_named_tensors(half)])
        assert weight_version(url) == "8"
        request(url, "update_weights_from_disk", model_path=str(tmp_path / "disk"))
        assert weight_version(url) == "9"
        torch.testing.assert_close(engine_logprobs(url, IDS), expected[3], atol=1e-5, rtol=0)
    finally:
        pool.close()
        server.stop()


def test_bad_weight_updates_are_refused_naming_the_field(tmp_path):
    core = EngineCore(reference_model(0), TOK, context_length=128)
    server = start_server(core)
    url = server.url
    try:
        lp0 = engine_logprobs(url, IDS)
        good = [("model.norm.weight", torch.ones(64)), ("lm_head.weight", torch.zeros(384, 64))]

        def refused(method: str, match: str, **fields) -> None:
            with pytest.raises(EngineHTTPError, match=match) as err:
                request(url, method, **fields)
            assert err.value.status == 400

        tensors = "update_weights_from_tensor"
        refused(
            tensors,
            r"serialized_named_tensors\[0\]: 'lm_head.weight' has shape \[3, 3\]",
            serialized_named_tensors=[encode_named_tensors(good + [("lm_head.weight", torch.zeros(3, 3))])],
        )
        refused(
            tensors,
            r"serialized_named_tensors\[0\]: 'model.nope.weight' is not a weight",
            serialized_named_tensors=[encode_named_tensors(good + [("model.nope.weight", torch.zeros(1))])],
        )
        refused(
            tensors,
            r"is FP8, but the engine holds it in torch.float32",
            serialized_named_tensors=[
                encode_named_tensors([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64).to(FP8_DTYPE))])
            ],
        )
        refused(
            tensors,
            r"serialized_named_tensors\[0\]: a pickle",
            serialized_named_tensors=[encode_named_tensors_sglang(good)],
        )
        refused(tensors, r"serialized_named_tensors: must hold one entry", serialized_named_tensors=[])
        refused(
            tensors,
            r"weight_version: expected str or int",
            serialized_named_tensors=[encode_named_tensors(good)],
            weight_version=["v2"],
        )
        refused(
            tensors,
            r"flush_cache: expected bool",
            serialized_named_tensors=[encode_named_tensors(good)],
            flush_cache="yes",
        )
        refused(
            tensors,
            r"load_format: 'flattened_bucket' is not supported",
            serialized_named_tensors=[encode_named_tensors(good)],
            load_format="flattened_bucket",
        )
        dist_fields = dict(names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]])
        dist = "update_weights_from_distributed"
        refused(dist, r"group_name: 'weight_update_group' is not initialized", **dist_fields)
        refused(dist, r"dtypes\[0\]: 'complex64' is not a supported dtype", **{**dist_fields, "dtypes": ["complex64"]})
        refused(dist, r"dtypes/shapes: need one per name", **{**dist_fields, "shapes": [[64], [1]]})
        refused(dist, r"shapes\[0\]: expected a list of non-negative integers", **{**dist_fields, "shapes": [[-1]]})
        refused(dist, r"names: must not be empty", **{**dist_fields, "names": []})
        refused("update_weights_from_disk", r"model_path: .* is not a directory", model_path=str(tmp_path / "no"))
        (tmp_path / "junk.safetensors").write_bytes(b"\x01\x00")
        refused("update_weights_from_disk", r"model_path: cannot read", model_path=str(tmp_path))
        group = dict(master_address="127.0.0.1", master_port=1, world_size=2)
        refused("init_weights_update_group", r"rank_offset: must be >= 1", rank_offset=0, **group)
        refused("init_weights_update_group", r"backend: 'nccl' needs an engine on CUDA", rank_offset=1, **group)
        refused(
            "init_weights_update_group", r"backend: expected 'gloo' or 'nccl'", rank_offset=1, backend="mpi", **group
        )
        refused("destroy_weights_update_group", r"does not exist", group_name="none")
        # nothing above changed a weight or the version, and the server still serves
        assert weight_version(url) == "0"
        torch.testing.assert_close(engine_logprobs(url, IDS), lp0, atol=0, rtol=0)
        with pytest.raises(ValueError, match=r"^model_path: required"):
            rx.update_weights_from_disk(core, {})
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------
# checksums: every engine holds exactly what the trainer sent
# --------------------------------------------------------------------------------------------


def test_tensor_digest_is_exact_and_sees_any_change():
    def reference(t: torch.Tensor) -> int:  # the definition, in Python integers
        from mcore_rl.rollout.weight_protocol import _MULTIPLIERS, _ROW, _TAIL_MULTIPLIER

        raw = bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())
        x = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw) // 8 * 8, 8)]
        level = 0
        while len(x) > 1:
            w = _MULTIPLIERS[level]
            x = [sum(v * w[j] for j, v in enumerate(x[r : r + _ROW])) for r in range(0, len(x), _ROW)]
            x = [(v + (1 << 63)) % (1 << 64) - (1 << 63) for v in x]
            level += 1
        d = x[0] if x else 0
        if len(raw) % 8:
            d += int.from_bytes(raw[len(raw) // 8 * 8 :].ljust(8, b"\0"), "little", signed=True) * _TAIL_MULTIPLIER
        return d % (1 << 64)

    odd = [torch.randn(3).bfloat16(), torch.randn(7).to(FP8_DTYPE), torch.randn(1), torch.zeros(0)]
    for t in [torch.randn(1100, 1030), *odd]:
        assert int(tensor_digest(t)) % (1 << 64) == reference(t)
        assert int(tensor_digest(t, mv=False)) % (1 << 64) == reference(t)  # the GPU path, here on CPU
    w = torch.randn(300, 300)
    flipped = w.clone()
    flipped.view(torch.uint8).view(-1)[777] ^= 1
    others = [flipped, w.t().contiguous(), w[[1, 0, *range(2, 300)]], torch.roll(w, 1)]
    assert len({int(tensor_digest(x)) for x in [w, *others]}) == 5
    # per name: order-independent, and name, dtype and shape count as well as the bytes
    named = [("a", torch.randn(6)), ("b", torch.randn(4, 4)), ("c", torch.randn(5).half())]
    sums = [WeightChecksum() for _ in range(5)]
    for n, t in named:
        sums[0].add(n, t)
    for n, t in reversed(named):
        sums[1].add(n, t)
    for n, t in named:
        sums[2].add("x" + n, t)
        sums[3].add(n, t.view(1, -1))
        sums[4].add(n, t.view(torch.int16) if t.dtype == torch.float16 else t)
    assert sums[0].hexdigest() == sums[1].hexdigest() and len(sums[0]) == 3
    assert len({c.hexdigest() for c in sums}) == 4  # the int16 view of the same bytes is another tensor too
    sums[1].discard(["a"])
    assert len(sums[1]) == 2 and sums[1].hexdigest() != sums[0].hexdigest()


def _send(transport, named, version: int, bucket_bytes: int = 1 << 16, **kw) -> SyncStats:
    """One sync as `WeightSync` makes it: the checksum taken while bucketing (in the background)."""
    stats = SyncStats(version, checksum=WeightChecksum(background=True))
    transport.send(iter_buckets(named, bucket_bytes, stats.checksum), version, stats, **kw)
    return stats


def _server_state(url: str) -> dict:
    return request(url, "get_server_info")["internal_states"][0]


@pytest.fixture(scope="module")
def servers():
    """An fp32 and an FP8 engine server in one other process, shared by the checksum tests."""
    proc = ServerProcess(engines=[{}, {"quantization": "fp8"}])
    try:
        yield proc.urls
    finally:
        proc.close()


def test_every_transport_leaves_each_engine_with_the_checksum_of_what_was_sent(servers, tmp_path):
    url, url8 = servers
    pool, pool8 = HTTPEnginePool([url]), HTTPEnginePool([url8])
    core = EngineCore(reference_model(0), TOK, context_length=128)
    transports = {
        "distributed, per tensor": DistributedTransport(pool, group_name="sum-per-tensor"),
        "distributed, flattened": DistributedTransport(pool, group_name="sum-flat", load_format="flattened_bucket"),
        "disk": DiskTransport(pool, str(tmp_path / "disk")),
        "tensor, shared memory": TensorTransport(pool, shm_dir=str(tmp_path)),
        "tensor, inline": TensorTransport(pool, payload="inline"),
    }
    try:
        seen = set()
        for version, (kind, transport) in enumerate(transports.items(), start=100):
            stats = _send(transport, reference_model(version).state_dict().items(), version)
            assert stats.mismatched == {}, kind
            reply = request(url, "weights_checksum")
            assert reply == {
                "weight_version": str(version),
                "checksum": stats.checksum.hexdigest(),
                "num_tensors": len(stats.checksum),
            }, kind
            assert not _server_state(url)["paused"] and pool.live == [url]
            seen.add(reply["checksum"])
        assert len(seen) == len(transports)  # other weights, another checksum
        # the same weights by another transport in other buckets: the same checksum
        same = _send(transports["disk"], reference_model(104).state_dict().items(), 105, bucket_bytes=1 << 20)
        assert not same.mismatched and same.checksum.hexdigest() in seen
        stats = _send(InProcessTransport([core]), reference_model(7).state_dict().items(), 7)
        assert stats.mismatched == {} and rx.weights_checksum(core)["checksum"] == stats.checksum.hexdigest()

        # FP8 engine: the trainer's e4m3 weights and scales, per tensor and flattened; and full
        # precision, which the engine quantizes itself (the checksum is of what arrived)
        for version, fmt in enumerate((None, "flattened_bucket"), start=200):
            transport = DistributedTransport(pool8, group_name=f"sum-fp8-{version}", load_format=fmt)
            named = list(quantize_for_fp8_engine(reference_model(version).state_dict().items()))
            assert any(t.dtype == FP8_DTYPE for _, t in named)
            stats = _send(transport, named, version)
            assert stats.mismatched == {}, fmt
            assert request(url8, "weights_checksum")["checksum"] == stats.checksum.hexdigest()
            transport.close()
        stats = _send(TensorTransport(pool8, shm_dir=str(tmp_path)), reference_model(202).state_dict().items(), 202)
        assert stats.mismatched == {} and pool8.live == [url8]
    finally:
        for t in transports.values():
            if hasattr(t, "close"):
                t.close()
        pool.close()
        pool8.close()


def test_a_corrupted_delivery_is_found_and_the_engine_held_until_sent_again(servers, tmp_path):
    url = servers[0]
    pool = HTTPEnginePool([url])
    weights = list(reference_model(300).state_dict().items())
    name, tensor = weights[0]

    def meddled(buckets):
        """Buckets as they come; once all are made (the first ones already loaded), another writer
        changes one tensor in the engine."""
        yield from buckets
        other = encode_named_tensors([(name, tensor + 1)])
        request(url, "update_weights_from_tensor", serialized_named_tensors=[other])

    def corrupted(buckets, directory):
        """Buckets as they come; once all are written, a byte of the first shard's data flips."""
        yield from buckets
        shard = directory / "model-00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0x40
        shard.write_bytes(data)

    try:
        tensors, disk = TensorTransport(pool, shm_dir=str(tmp_path)), DiskTransport(pool, str(tmp_path / "disk"))
        cases = [(tensors, lambda b: meddled(b)), (disk, lambda b: corrupted(b, tmp_path / "disk"))]
        for version, (transport, spoil) in enumerate(cases, start=301):
            stats = SyncStats(version, checksum=WeightChecksum())
            transport.send(spoil(iter_buckets(weights, 1 << 16, stats.checksum)), version, stats)
            assert list(stats.mismatched) == [url]
            assert f"checksum {stats.checksum.hexdigest()}" in stats.mismatched[url]  # both checksums, named
            assert request(url, "weights_checksum")["checksum"] != stats.checksum.hexdigest()
            # not serving: paused, out of routing, and no health check takes it back
            assert _server_state(url)["paused"] and pool.live == [] and pool.states.mixed(url)
            asyncio.run_coroutine_threadsafe(pool.router.check_health(), pool._loop).result()
            assert pool.live == []
            again = _send(transport, weights, version, only=list(stats.mismatched))
            assert again.mismatched == {} and pool.live == [url] and not _server_state(url)["paused"]
            assert request(url, "weights_checksum")["checksum"] == again.checksum.hexdigest()
        tensors.close()
    finally:
        pool.close()


def test_engines_without_the_checksum_endpoint_are_not_checked(tmp_path, caplog):
    """A real SGLang server answers 404 to /weights_checksum: logged once, the sync goes on."""
    from aiohttp import web

    class NoChecksum(EngineServer):
        async def weights_checksum(self, request):
            raise web.HTTPNotFound()

    server = ServerThread(NoChecksum(EngineDriver(EngineCore(reference_model(0), TOK, context_length=128))))
    server.start()
    pool = HTTPEnginePool([server.url])
    try:
        transport = TensorTransport(pool, shm_dir=str(tmp_path))
        with caplog.at_level("WARNING", logger="mcore_rl.rollout.pool"):
            for version in (1, 2):
                assert _send(transport, reference_model(version).state_dict().items(), version).mismatched == {}
                assert weight_version(server.url) == str(version) and pool.live == [server.url]
        assert caplog.text.count("has no /weights_checksum") == 1
        transport.close()
    finally:
        pool.close()
        server.stop()


# --------------------------------------------------------------------------------------------
# trainer side: gathering shards in every layout (2-rank gloo worlds)
# --------------------------------------------------------------------------------------------

DENSE = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128)
TIED = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, tie_word_embeddings=True)
MOE = ModelConfig.of(
    arch="qwen3_moe",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    moe_shared_expert_intermediate_size=96,
)


def _gather_world(rank: int, world_size: int, cases) -> None:
    from mcore_rl.hf.weight_map import full_megatron_to_hf
    from mcore_rl.models.shards import gather_full_state_dict
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.weight_sync import iter_hf_weights

    for mc, pc in cases:
        init_model_parallel(pc)
        set_seed(3)
        chunks = build_model(mc, pc)
        expected = full_megatron_to_hf(gather_full_state_dict(chunks), mc)
        got = list(iter_hf_weights(chunks, mc, bucket_bytes=48 << 10))  # several buckets per stage
        if rank != 0:
            assert got == [], f"{pc}: only rank 0 holds full tensors"
            continue
        names = [n for n, _ in got]
        assert len(names) == len(set(names)) and set(names) == set(expected), (
            f"{mc.arch} {pc}: {set(names) ^ set(expected)}"
        )
        for name, tensor in got:
            assert torch.equal(tensor.cpu(), expected[name]), f"{mc.arch} {pc}: {name}"


@pytest.mark.slow
def test_gathered_hf_weights_equal_the_exporters_in_every_layout():
    run_world(
        2,
        _gather_world,
        [
            (DENSE, P(tp=2, sp=True)),
            (DENSE, P(pp=2)),  # the second stage streams its buckets to rank 0
            (DENSE, P(pp=2, vpp=2)),
            (DENSE, P()),  # DP=2: only the first replica gathers
            (TIED, P(pp=2)),  # the last stage's copy of the tied embedding is not sent
            (MOE, P(ep=2)),  # experts gathered across EP
            (MOE, P(tp=2, sp=True)),  # experts gathered across ETP
        ],
    )


# --------------------------------------------------------------------------------------------
# end to end: TP=2 megatron-core trainer -> engines in other processes, every transport
# --------------------------------------------------------------------------------------------


def _perturb(chunks, seed: int) -> None:
    """New trainer weights (as training would make them); replicated tensors stay identical
    across TP ranks because every rank draws the same noise for the same name and shape."""
    from mcore_rl.models.shards import iter_local_params

    with torch.no_grad():
        for _, name, p in iter_local_params(chunks):
            g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.15 if p.ndim == 2 else 1.0 + 0.3 * noise)


def _trainer_logprobs(chunks, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) from the megatron-core model: minus its vocab-parallel CE loss."""
    tokens = torch.tensor([ids[:-1]])
    labels = torch.tensor([ids[1:]])
    with torch.no_grad():
        loss = chunks[0](tokens, torch.arange(tokens.shape[1])[None], None, labels=labels)
    return -loss[0].float()


@dataclass
class Meddling:
    """A real transport, with another writer changing one tensor in the engine at `url` while each
    of the first `times` sends is under way: once every bucket is made, when the first ones (with the
    embedding) are loaded and the last ones not yet."""

    inner: TensorTransport
    url: str
    times: int
    sends: list = field(default_factory=list)

    def send(self, buckets, version: int, stats: SyncStats, only=None) -> None:
        self.sends.append(only)

        def meddled():
            yield from buckets
            if self.times > 0:
                self.times -= 1
                rogue = [("model.embed_tokens.weight", torch.zeros(384, 64))]
                request(self.url, "update_weights_from_tensor", serialized_named_tensors=[encode_named_tensors(rogue)])

        self.inner.send(meddled(), version, stats, only)


def _sync_world(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.setup import init_model_parallel, set_seed

    mc, pc = ModelConfig(), P(tp=2)  # the engine's demo model has ModelConfig() defaults
    init_model_parallel(pc)
    set_seed(1)
    chunks = build_model(mc, pc)
    fp32 = fp8 = pool32 = pool8 = servers = None
    if rank == 0:
        servers = ServerProcess(engines=[{}, {"quantization": "fp8"}])
        fp32, fp8 = servers.urls
        pool32, pool8 = HTTPEnginePool([fp32]), HTTPEnginePool([fp8])
    try:
        transports = {
            "distributed": lambda: DistributedTransport(pool32, group_name="fp32"),
            "disk": lambda: DiskTransport(pool32, os.path.join(tmp, "sync")),
            "tensor": lambda: TensorTransport(pool32),
        }
        for version, kind in enumerate(transports, start=1):
            _perturb(chunks, version)
            trainer = _trainer_logprobs(chunks, IDS)
            transport = transports[kind]() if rank == 0 else None
            if rank == 0:
                assert (engine_logprobs(fp32, IDS) - trainer).abs().max() > 0.05, "the engine had these weights"
            stats = WeightSync(chunks, mc, transport, bucket_bytes=96 << 10).sync(version)
            if rank == 0:
                assert stats.buckets > 1 and stats.bytes > 0
                diff = (engine_logprobs(fp32, IDS) - trainer).abs().max()
                assert diff <= 1e-5, f"{kind}: engine log-probs differ from the trainer's by {diff}"
                assert weight_version(fp32) == str(version)
            if kind == "distributed":  # the group stays up for later syncs until closed
                _perturb(chunks, 99)
                trainer = _trainer_logprobs(chunks, IDS)
                WeightSync(chunks, mc, transport, bucket_bytes=96 << 10).sync(42)
                if rank == 0:
                    assert (engine_logprobs(fp32, IDS) - trainer).abs().max() <= 1e-5
                    assert weight_version(fp32) == "42"
                    # a bucket the engine refuses: the broadcast still completes, nothing changes; the
                    # engine stays paused and out of routing all the same (after a failed bucket of a
                    # longer sync it would hold a mix) until the next sync reaches it
                    bad = [("model.norm.weight", torch.zeros(64)), ("model.nope.weight", torch.zeros(3))]
                    with pytest.raises(EngineHTTPError, match="names: 'model.nope.weight' is not a weight"):
                        transport.send([bad], 43, SyncStats(43))
                    assert weight_version(fp32) == "42" and pool32.live == [] and _server_state(fp32)["paused"]
                    request(fp32, "continue_generation")
                    assert (engine_logprobs(fp32, IDS) - trainer).abs().max() <= 1e-5
            if rank == 0 and kind in ("distributed", "tensor"):
                transport.close()

        # checksums: another writer changes a tensor in the engine while the sync is under way; the
        # engine gets the whole sync once more (both ranks gather again); twice in a row is an error
        # on every rank, and the engine is held until a sync reaches it
        for version, times in ((50, 1), (51, 2)):
            _perturb(chunks, version)
            trainer = _trainer_logprobs(chunks, IDS)
            transport = Meddling(TensorTransport(pool32), fp32, times) if rank == 0 else None
            sync = WeightSync(chunks, mc, transport, bucket_bytes=96 << 10)
            if times == 1:
                stats = sync.sync(version)
                if rank == 0:
                    assert transport.sends == [None, [fp32]] and stats.resynced == [fp32] and not stats.mismatched
                    assert (engine_logprobs(fp32, IDS) - trainer).abs().max() <= 1e-5
                    assert weight_version(fp32) == str(version) and pool32.live == [fp32]
            else:
                match = (
                    rf"version 51, sent twice: engine {fp32} reports .* the trainer sent weight_version 51, "
                    r"checksum [0-9a-f]{16}"
                    if rank == 0
                    else "failed on global rank 0"
                )
                with pytest.raises(WeightSyncError, match=match):
                    sync.sync(version)
                if rank == 0:
                    assert pool32.live == [] and _server_state(fp32)["paused"]
            if rank == 0:
                transport.inner.close()
        transport = TensorTransport(pool32) if rank == 0 else None
        WeightSync(chunks, mc, transport, bucket_bytes=96 << 10).sync(52)
        if rank == 0:
            assert pool32.live == [fp32] and weight_version(fp32) == "52"
            transport.close()

        # FP8 engine: quantized during the sync; per-tensor broadcasts (SGLang's default format)
        _perturb(chunks, 7)
        trainer = _trainer_logprobs(chunks, IDS)
        transport = DistributedTransport(pool8, group_name="fp8", load_format=None) if rank == 0 else None
        WeightSync(chunks, mc, transport, bucket_bytes=96 << 10, quantization="fp8").sync(7)
        if rank == 0:
            d = trainer - engine_logprobs(fp8, IDS)
            mismatch = k3(d)
            print(
                f"\nFP8 engine vs TP=2 fp32 trainer: mean |d| = {d.abs().mean():.3e}, "
                f"max |d| = {d.abs().max():.3e}, mean token K3 = {mismatch:.3e} ({len(d)} tokens)"
            )
            assert 1e-7 < mismatch < 5e-2
            assert weight_version(fp8) == "7"
            transport.close()
    finally:
        for e in (pool32, pool8, servers):
            if e is not None:
                e.close()


@pytest.mark.slow
def test_tp2_trainer_to_engines_over_every_transport(tmp_path):
    run_world(2, _sync_world, str(tmp_path))


_KILLED_TRAINER = """
import sys, time, torch
from mcore_rl.rollout.engine.core import EngineCore
from mcore_rl.rollout.engine.driver import EngineDriver
from mcore_rl.rollout.server import EngineServer, ServerThread
from mcore_rl.rollout.pool import HTTPEnginePool
from mcore_rl.rollout.weight_transports import SyncStats, TensorTransport
from mcore_rl.train.weight_sync import iter_buckets
from tests.helpers import _weights
torch.set_num_threads(1)
srv = ServerThread(EngineServer(EngineDriver(EngineCore.from_model_path(None, context_length=64, random_seed=0))),
                   shutdown_timeout=0.5)
srv.start()
pool = HTTPEnginePool([srv.url], timeout=30)
TensorTransport(pool, shm_dir=sys.argv[1]).send(iter_buckets(_weights(1), 1 << 16), 1, SyncStats(1))
print("synced", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_trainer_leaves_no_weight_buckets_in_shared_memory(tmp_path):
    """Shared memory is RAM that outlives the process: the buckets of a trainer killed with
    SIGKILL after a sync are removed when it dies, and a trainer that starts (or resumes) removes
    those an earlier, dead one left (here one whose pid is that of an exited process)."""
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shm = tmp_path / "shm"
    shm.mkdir()
    exited = subprocess.Popen(["true"])
    exited.wait()
    orphan = shm / f"mcore_rl_weights_{exited.pid}_0123abcd_0.safetensors"
    orphan.write_bytes(b"\0" * 4096)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    trainer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_TRAINER, str(shm)], stdout=subprocess.PIPE, text=True, env=env, cwd=root
    )
    try:
        assert trainer.stdout.readline().strip() == "synced"
        names = sorted(p.name for p in shm.iterdir())
        assert len(names) == 2 and all(n.startswith(f"mcore_rl_weights_{trainer.pid}_") for n in names), names
        trainer.kill()
        trainer.wait(10)
        end = time.monotonic() + 10
        while list(shm.iterdir()) and time.monotonic() < end:
            time.sleep(0.1)
        assert not list(shm.iterdir()), "the killed trainer's buckets are still in shared memory"
    finally:
        trainer.kill()
        trainer.wait()
