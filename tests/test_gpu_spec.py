"""The rows of `tools/gpu_spec_check.py` as tests: speculative decoding on CUDA (the embedded engine's
greedy tokens equal plain decoding's with both drafts and both schedules; SGLang started with
`config/speculative.py`'s flags serves plain greedy tokens). Marked `gpu`: skipped without CUDA."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

import pytest

pytestmark = pytest.mark.gpu
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_spec_check", ROOT / "tools" / "gpu_spec_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ctx(tool: ModuleType, tmp_path) -> object:
    return tool.gc.Context(str(tmp_path), 300, True)


def test_embedded_engine_speculates_exactly_on_cuda(tmp_path) -> None:
    tool = _tool()
    result = tool.embedded_on_cuda(_ctx(tool, tmp_path))
    assert result.startswith("greedy = plain"), result


def test_sglang_with_our_flags_serves_plain_greedy_tokens(tmp_path) -> None:
    tool = _tool()
    try:
        result = tool.sglang_with_our_flags(_ctx(tool, tmp_path))
    except tool.gc.Skip as why:
        pytest.skip(str(why))
    assert "greedy tokens agree for 48/48" in result, result
