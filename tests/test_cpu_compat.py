"""The CPU compatibility layer for megatron-core: scoped, version-pinned, and correct."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.parallel import cpu_compat
from tests.world import run_world


@pytest.fixture(scope="module", autouse=True)
def _applied():
    cpu_compat.apply(force=True)


def test_megatron_sees_cpu_cuda_but_torch_is_untouched():
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.mappings as mappings

    view = schedules.torch
    assert view is not torch and mappings.torch is view
    assert view.cuda.current_device() == "cpu"
    assert view.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert view.device("cuda", 0) == torch.device("cpu")
    assert isinstance(torch.device("cpu"), view.device)
    view.cuda.synchronize()
    with view.cuda.stream(view.cuda.Stream()):
        pass
    # Everything else is the real torch; the real torch.cuda is not patched.
    assert view.Tensor is torch.Tensor and view.distributed is torch.distributed
    if not torch.cuda.is_available():
        assert torch.cuda.current_device is not view.cuda.current_device


def test_modules_imported_later_are_patched_too():
    import importlib
    import sys

    name = "megatron.core.transformer.moe.shared_experts"
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    assert module.torch is cpu_compat._TORCH_VIEW


def test_rng_tracker_forks_cpu_generator_and_restores_it():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(0)
    tracker.add("stream-a", 42)
    before = torch.get_rng_state()
    with tracker.fork("stream-a"):
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    tracker.reset()
    tracker.add("stream-a", 42)
    with tracker.fork("stream-a"):
        assert torch.equal(torch.rand(3), inside)  # same seed, same stream


def test_alltoall_split_sizes_become_host_arrays():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert list(splits) == [3, 1] and not torch.is_tensor(splits)
    assert moe_utils.te_general_gemm is None or moe_utils.HAVE_TE


def test_refuses_an_unsupported_megatron_version(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_applied", False)
    monkeypatch.setattr(cpu_compat, "megatron_core_version", lambda: "0.99.0")
    with pytest.raises(RuntimeError, match="megatron-core==0.16.1.*found 0.99.0"):
        cpu_compat.apply(force=True)


def test_inactive_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_applied", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply() is False
    assert not cpu_compat.is_active()


def _uneven_collectives(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    group = dist.new_group([0, 1])
    sizes = [2, 3]
    mine = torch.full((sizes[rank], 4), float(rank + 1))
    gathered = mappings._gather_along_first_dim(mine, group, sizes)
    expected = torch.cat([torch.full((2, 4), 1.0), torch.full((3, 4), 2.0)])
    assert torch.equal(gathered, expected)
    full = torch.arange(20.0).reshape(5, 4) * (rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, sizes)
    start = sum(sizes[:rank])
    assert torch.equal(scattered, (torch.arange(20.0).reshape(5, 4) * 3)[start : start + sizes[rank]])
    # The equal-size paths go straight to megatron-core's own implementation.
    equal = mappings._gather_along_first_dim(torch.full((2, 4), float(rank)), group)
    assert equal.shape == (4, 4)


@pytest.mark.slow
def test_uneven_gather_and_reduce_scatter_over_gloo():
    run_world(2, _uneven_collectives)
