"""Run megatron-core 0.16.1 on a machine without CUDA (gloo, CPU tensors).

megatron-core assumes CUDA in a few dozen places: `torch.cuda.current_device()` as a device,
`device="cuda"` literals, CUDA streams/events in the MoE dispatcher, CUDA RNG state in the
tensor-parallel RNG tracker. Instead of editing those call sites we give every `megatron.core.*`
module its own view of `torch` in which `torch.cuda` answers for the CPU and tensor factories map
`"cuda"` to `"cpu"`. The real `torch` module, and every other library, are untouched.

The layer is inactive when CUDA is available, and it refuses to run on a megatron-core version it
was not written against (see `SUPPORTED_MEGATRON_CORE`), so an upgrade fails loudly instead of
silently running half-patched code.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Any
from collections.abc import Callable

import torch

SUPPORTED_MEGATRON_CORE = "0.16.1"

_applied = False


class _NullStream:
    """Stands in for `torch.cuda.Stream`: on CPU all work is already ordered."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return _NullEvent()

    def query(self) -> bool:
        return True


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_NULL_STREAM = _NullStream()


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):  # an ordinal means "that GPU"
        return "cpu"
    return device


def _device_remapping(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    return wrapper


class _CudaOnCpu(types.ModuleType):
    """`torch.cuda` as megatron-core sees it on a CPU-only machine."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.current_device = lambda: "cpu"
        self.synchronize = lambda *a, **k: None
        self.Stream = lambda *a, **k: _NullStream()
        self.Event = _NullEvent
        self.current_stream = lambda *a, **k: _NULL_STREAM
        self.default_stream = lambda *a, **k: _NULL_STREAM
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.empty_cache = lambda: None
        # The tensor-parallel RNG tracker keeps named generator states; on CPU they are states of
        # the CPU default generator.
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = lambda seed: torch.random.default_generator.manual_seed(int(seed))
        self.memory_allocated = lambda *a, **k: 0
        self.max_memory_allocated = lambda *a, **k: 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchForMegatron(types.ModuleType):
    """`torch` as megatron-core sees it: everything real except `cuda` and device literals."""

    _FACTORIES = (
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "arange",
        "randn",
        "rand",
        "randint",
        "as_tensor",
        "empty_like",
        "zeros_like",
        "ones_like",
    )

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in self._FACTORIES:
            setattr(self, name, _device_remapping(getattr(torch, name)))
        self.device = _TorchDevice

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _TorchDeviceMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.device)


class _TorchDevice(metaclass=_TorchDeviceMeta):
    """`torch.device("cuda", i)` becomes the CPU device; isinstance checks still work."""

    def __new__(cls, *args: Any, **kwargs: Any) -> torch.device:  # type: ignore[misc]  # a stand-in class whose constructor returns a real torch.device
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)


_TORCH_VIEW: _TorchForMegatron | None = None


def _patch_module(module: types.ModuleType) -> None:
    if getattr(module, "torch", None) is torch:
        module.torch = _TORCH_VIEW  # type: ignore[attr-defined]  # patching a megatron-core module


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches `megatron.core.*` modules imported after `apply()` as they load."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith("megatron.core"):
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original_exec = loader.exec_module

                def exec_module(module: types.ModuleType, _orig=original_exec) -> None:
                    _orig(module)
                    _patch_module(module)
                    _fix_module_functions(module)

                spec.loader = _LoaderProxy(loader, exec_module)
                return spec
        return None


class _LoaderProxy(importlib.abc.Loader):
    def __init__(self, loader: Any, exec_module: Callable[[types.ModuleType], None]) -> None:
        self._loader = loader
        self._exec_module = exec_module

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._exec_module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _move_to_cpu_for_alltoall(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """The alltoall dispatcher wants split sizes as host data; on CPU that means numpy, not a tensor."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def _uneven_gather_fix(original: Callable[..., Any]) -> Callable[..., Any]:
    """gloo's all_gather needs equal sizes; the MoE dispatcher under TP gathers unequal ones."""

    def gather(
        input_: torch.Tensor, group: Any, output_split_sizes: Any = None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, *args, **kwargs)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)

    return gather


def _uneven_reduce_scatter_fix(original: Callable[..., Any]) -> Callable[..., Any]:
    """gloo has no uneven reduce-scatter: all-reduce the whole tensor, keep this rank's rows."""

    def reduce_scatter(
        input_: torch.Tensor, group: Any, input_split_sizes: Any = None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, *args, **kwargs)
        summed = input_.contiguous().clone()
        torch.distributed.all_reduce(summed, group=group)
        sizes = [int(n) for n in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return summed[start : start + sizes[group.rank()]].clone()

    return reduce_scatter


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """`tensor.cuda()` is a method, out of reach of the torch view; disable it for one call."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _without_tensor_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _tensor_cuda_is_identity():
            return fn(*args, **kwargs)

    wrapper._mcore_rl_cpu = True  # type: ignore[attr-defined]  # patching a megatron-core module
    return wrapper


def _fix_module_functions(module: types.ModuleType) -> None:
    """Replace the few functions that are wrong on CPU even with the torch view in place."""
    name = module.__name__
    if name == "megatron.core.transformer.moe.moe_utils":
        module.maybe_move_tensor_to_cpu = _move_to_cpu_for_alltoall  # type: ignore[attr-defined]  # patching a megatron-core module
        if not hasattr(module, "te_general_gemm"):
            module.te_general_gemm = None  # type: ignore[attr-defined]  # patching a megatron-core module
    elif name == "megatron.core.transformer.moe.token_dispatcher":
        if hasattr(module, "maybe_move_tensor_to_cpu"):
            module.maybe_move_tensor_to_cpu = _move_to_cpu_for_alltoall  # type: ignore[attr-defined]  # patching a megatron-core module
    elif name == "megatron.core.models.common.language_module.language_module":
        # Tied embeddings under PP: the first and last stage all-reduce `weight.data.cuda()`.
        cls = module.LanguageModule
        if not getattr(cls.setup_embeddings_and_output_layer, "_mcore_rl_cpu", False):
            cls.setup_embeddings_and_output_layer = _without_tensor_cuda(cls.setup_embeddings_and_output_layer)
    elif name == "megatron.core.tensor_parallel.mappings":
        if not getattr(module, "_mcore_rl_cpu", False):
            module._gather_along_first_dim = _uneven_gather_fix(module._gather_along_first_dim)  # type: ignore[attr-defined]  # patching a megatron-core module
            module._reduce_scatter_along_first_dim = _uneven_reduce_scatter_fix(  # type: ignore[attr-defined]  # patching a megatron-core module
                module._reduce_scatter_along_first_dim
            )
            module._mcore_rl_cpu = True  # type: ignore[attr-defined]  # patching a megatron-core module
    elif name == "megatron.core.tensor_parallel.random":
        module._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[attr-defined]  # patching a megatron-core module
        module._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[attr-defined]  # patching a megatron-core module


def megatron_core_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def needed() -> bool:
    return not torch.cuda.is_available()


def apply(force: bool = False) -> bool:
    """Make megatron-core usable on CPU. Returns True when the layer is active.

    Safe to call many times. Does nothing when CUDA is available unless `force` (tests use that
    to exercise the layer's own logic).
    """
    global _applied, _TORCH_VIEW
    if _applied:
        return True
    if not (needed() or force):
        return False
    found = megatron_core_version()
    if found != SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"mcore_rl's CPU compatibility layer supports megatron-core=={SUPPORTED_MEGATRON_CORE}, "
            f"found {found}. Install the pinned version (see pyproject.toml) or port "
            "mcore_rl/parallel/cpu_compat.py."
        )
    _TORCH_VIEW = _TorchForMegatron()
    sys.meta_path.insert(0, _PatchOnImport())
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("megatron.core") and module is not None:
            _patch_module(module)
            _fix_module_functions(module)
    _applied = True
    return True


def is_active() -> bool:
    return _applied
