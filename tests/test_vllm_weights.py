"""vLLM's NCCL weight transfer (`rollout/vllm_weights.py`).

On CPU: the transport's requests, through the real `HTTPEnginePool` and `VLLMEngineClient`, to
stand-in servers on loopback that answer vLLM 0.32's weight routes and take each tensor from an
in-process wire in place of NCCL (the server's `/update_weights` waits for the tensors its names
announce, in order, and checks their dtype and shape, as a worker's `torch.empty` + broadcast
would). On GPU (`gpu` marker): the ctypes communicator itself, and a whole sync to a GPU vLLM
server when `MCORE_RL_VLLM_GPU_URL` names one (`tools/setup_vllm.sh --gpu`, then vLLM started with
`VLLM_SERVER_DEV_MODE=1 --weight-transfer-config '{"backend": "nccl"}'`).
"""

from __future__ import annotations

import asyncio
import base64
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from aiohttp import web

from mcore_rl.rollout.pool import HTTPEnginePool
from mcore_rl.rollout.vllm_client import VLLMEngineClient
from mcore_rl.rollout.vllm_weights import NCCL_UNIQUE_ID_BYTES, VLLMNcclTransport, init_info, update_info
from mcore_rl.rollout.weight_transports import SyncStats

UID = bytes(range(NCCL_UNIQUE_ID_BYTES))


class Wire:
    """NCCL in place: what the trainer's rank broadcasts reaches every other rank of its group,
    whose stand-in server takes it in order."""

    def __init__(self) -> None:
        self.queues: dict[int, queue.Queue[torch.Tensor]] = {}  # by rank
        self.members: list[tuple[bytes, int, int]] = []  # (unique id, rank, world size) of each join
        self.destroyed = 0

    def queue(self, rank: int) -> queue.Queue[torch.Tensor]:
        return self.queues.setdefault(rank, queue.Queue())

    def communicator(self, uid: bytes, rank: int, world_size: int, device: torch.device) -> Any:
        self.members.append((uid, rank, world_size))
        wire = self

        class Comm:
            def __init__(self) -> None:
                self.device = device

            def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
                assert tensor.is_contiguous()
                for rank in range(1, world_size):
                    wire.queue(rank).put(tensor.clone())

            def synchronize(self) -> None:
                pass

            def destroy(self) -> None:
                wire.destroyed += 1

        return Comm()


class StandIn:
    """A server answering vLLM's pause and weight routes; `calls`: (route, body) in order."""

    def __init__(self, wire: Wire) -> None:
        self.wire, self.rank = wire, 0  # its worker's rank in the group, from the last init
        self.calls: list[tuple[str, Any]] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.version = "default"
        self.fail_update = False

    def app(self) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            route = request.path
            body = await request.json() if request.can_read_body else None
            self.calls.append((route, body))
            if route == "/init_weight_transfer_engine":
                self.rank = body["init_info"]["rank_offset"]
            if route == "/weight_info":
                return web.json_response({"weight_version": self.version})
            if route == "/update_weights":
                if self.fail_update:
                    return web.json_response({"error": "bad"}, status=400)
                info = body["update_info"]
                for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
                    tensor = await asyncio.get_running_loop().run_in_executor(None, self._take)
                    assert tensor.dtype == getattr(torch, dtype) and list(tensor.shape) == shape
                    self.weights[name] = tensor
            if route == "/finish_weight_update":
                self.version = body["weight_version"]
            return web.json_response({})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    def _take(self) -> torch.Tensor:
        return self.wire.queue(self.rank).get(timeout=10)


@pytest.fixture
def servers() -> Iterator[tuple[Wire, list[StandIn], list[str]]]:
    wire = Wire()
    stand_ins = [StandIn(wire), StandIn(wire)]
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []
    urls: list[str] = []

    async def start() -> None:
        for s in stand_ins:
            runner = web.AppRunner(s.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield wire, stand_ins, urls
    finally:
        for r in runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _bucket(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(8, 4, generator=g)),
        ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(4, 8, generator=g).t()),  # not contiguous: sent as a contiguous copy
    ]


def _routes(s: StandIn) -> list[str]:
    return [route for route, _ in s.calls if route not in ("/health", "/weight_info")]


def test_a_sync_forms_the_group_once_announces_each_bucket_and_sets_the_version(servers) -> None:
    wire, stand_ins, urls = servers
    pool = HTTPEnginePool(urls, timeout=30, health_interval=60, client_factory=VLLMEngineClient)
    try:
        transport = VLLMNcclTransport(
            pool, communicator=wire.communicator, mint=lambda: UID, device=torch.device("cpu")
        )
        buckets = [_bucket(1)[:2], _bucket(1)[2:]]
        transport.send(buckets, 3, SyncStats(3))

        assert wire.members == [(UID, 0, 3)]  # the trainer is rank 0 of 1 + 2 engines
        for i, s in enumerate(stand_ins):
            assert _routes(s) == [
                "/pause",
                "/init_weight_transfer_engine",
                "/start_weight_update",
                "/update_weights",
                "/update_weights",
                "/finish_weight_update",
                "/reset_prefix_cache",
                "/resume",
            ]
            init = dict(s.calls)["/init_weight_transfer_engine"]["init_info"]
            assert init == {
                "nccl_unique_id_b64": base64.b64encode(UID).decode(),
                "rank_offset": 1 + i,
                "world_size": 3,
                "packed": False,
            }
            for name, tensor in _bucket(1):
                assert torch.equal(s.weights[name], tensor)
            assert s.version == "3"
        assert pool.weight_version == 3

        for s in stand_ins:
            s.calls.clear()
        transport.send([_bucket(2)], 4, SyncStats(4))  # the same members: the group stays
        assert wire.members == [(UID, 0, 3)]
        assert _routes(stand_ins[0]) == [
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
        ]

        for s in stand_ins:
            s.calls.clear()
        transport.send([_bucket(3)], 5, SyncStats(5), only=urls[:1])  # other members: shut down, formed anew
        assert wire.members[-1] == (UID, 0, 2) and wire.destroyed == 1
        assert "/shutdown_weight_transfer_engine" in _routes(stand_ins[1])
        assert "/init_weight_transfer_engine" not in _routes(stand_ins[1])
        assert dict(stand_ins[0].calls)["/init_weight_transfer_engine"]["init_info"]["rank_offset"] == 1

        stand_ins[0].fail_update = True  # an engine refusing a bucket: the sync fails, the group is dropped
        with pytest.raises(Exception, match="400"):
            transport.send([_bucket(4)], 6, SyncStats(6), only=urls[:1])
        assert wire.destroyed == 2 and transport._comm is None
        transport.close()
    finally:
        pool.close()


def test_init_and_update_info_are_vllms_wire_format() -> None:
    info = init_info(UID, 2, 3)
    assert base64.b64decode(info["nccl_unique_id_b64"], validate=True) == UID
    assert (info["rank_offset"], info["world_size"], info["packed"]) == (2, 3, False)
    meta = update_info(_bucket(0))
    assert meta == {
        "names": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
        "dtype_names": ["float32", "bfloat16", "float32"],  # getattr(torch, name) on the worker
        "shapes": [[8, 4], [4], [8, 4]],
    }


@pytest.mark.gpu
def test_the_nccl_communicator_joins_by_unique_id_and_broadcasts() -> None:
    """A group of one (one GPU here): init from a minted unique id, the warm-up, an all-reduce and
    a broadcast through libnccl's C API, in each dtype the engines take."""
    from mcore_rl.rollout.vllm_weights import NcclCommunicator

    device = torch.device("cuda", 0)
    uid = NcclCommunicator.unique_id()
    assert len(uid) == NCCL_UNIQUE_ID_BYTES and uid != NcclCommunicator.unique_id()
    comm = NcclCommunicator(uid, 0, 1, device)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
            t = torch.arange(6, device=device).to(dtype).reshape(2, 3)
            comm.broadcast(t)
            comm.all_reduce(t)
            comm.synchronize()
            assert torch.equal(t.cpu(), torch.arange(6).to(dtype).reshape(2, 3))
        with pytest.raises(ValueError, match="contiguous"):
            comm.broadcast(torch.zeros(4, 4, device=device).t())
    finally:
        comm.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not os.environ.get("MCORE_RL_VLLM_GPU_URL"), reason="no GPU vLLM server (MCORE_RL_VLLM_GPU_URL)")
def test_a_sync_to_a_gpu_vllm_server_changes_its_output() -> None:
    """Against a running GPU vLLM server of any stock model: weights scaled by 0 change its greedy
    output; the model's own weights (read back from its checkpoint) restore it."""
    from safetensors.torch import load_file

    from mcore_rl.rollout.pool import GenRequest

    url = os.environ["MCORE_RL_VLLM_GPU_URL"]
    checkpoint = os.environ["MCORE_RL_VLLM_GPU_WEIGHTS"]  # the server's model.safetensors
    weights = list(load_file(checkpoint).items())
    pool = HTTPEnginePool([url], timeout=120, health_interval=60, client_factory=VLLMEngineClient)
    transport = VLLMNcclTransport(pool)
    try:
        greedy = [GenRequest([1, 2, 3, 4], {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})]
        before = pool.generate(greedy)[0].output_ids
        transport.send([[(n, torch.zeros_like(t)) for n, t in weights]], 1, SyncStats(1))
        assert pool.weight_version == 1 and pool.generate(greedy)[0].output_ids != before
        transport.send([weights], 2, SyncStats(2))
        assert pool.generate(greedy)[0].output_ids == before
    finally:
        transport.close()
        pool.close()
