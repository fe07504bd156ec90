"""`mcore_rl.hf` stays pure: exports load as remote code with neither mcore_rl nor megatron-core.

The reference modeling doubles as the remote code of exported checkpoints, so it must import only
torch, transformers and its own siblings. Checked three ways: exports of the architectures that need
remote code load and run in a fresh interpreter that cannot import either package; importing
`mcore_rl.hf` imports no megatron; the sibling modules import each other as a DAG at module level.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import torch

from tests.helpers import REMOTE_CASES, ROOT, _tokens
from tests.helpers import _reference_state

HF_DIR = os.path.join(ROOT, "mcore_rl", "hf")
# One architecture per remote-code module (latent_moe.py, attn_res.py, ngram.py).
CASES = ("latent_moe", "attn_res_block", "ngram")

# A fresh interpreter, cwd a temp dir, with no sys.path entry that holds an `mcore_rl` package and a
# finder that fails every `mcore_rl` / `megatron` import; loads each export, saves its logits.
_LOAD_PURE = textwrap.dedent(
    """
    import importlib.abc, json, os, sys
    BLOCKED = ("mcore_rl", "megatron")
    class _Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this process")
    sys.meta_path.insert(0, _Blocked())
    sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "mcore_rl"))]
    import torch
    from transformers import AutoModelForCausalLM
    exports, tokens, out = json.loads(sys.argv[1]), torch.load(sys.argv[2]), sys.argv[3]
    logits = {}
    for name, path in exports.items():
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            logits[name] = model(tokens).logits
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    torch.save(logits, out)
    """
)


def test_remote_code_exports_load_without_mcore_rl_or_megatron(tmp_path) -> None:
    """LatentMoE, AttnRes and n-gram exports (tiny, HF-named weights, the real exporter) load with
    `trust_remote_code=True` and give the reference model's logits, with nothing of either package."""
    from mcore_rl.convert import write_hf_checkpoint
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    x = _tokens()
    exports, want = {}, {}
    for case in CASES:
        mc = REMOTE_CASES[case]
        state = _reference_state(mc)
        exports[case] = str(tmp_path / case)
        assert write_hf_checkpoint(state, mc, exports[case]) == "remote"
        model = McoreRLForCausalLM(hf_config_from_model_config(mc)).eval()
        model.load_state_dict(state)
        with torch.no_grad():
            want[case] = model(x).logits
    shipped = {name for name in os.listdir(tmp_path / "latent_moe") if name.endswith(".py")}
    assert {"configuration.py", "modeling.py", "layers.py", "latent_moe.py", "attn_res.py", "ngram.py"} <= shipped
    torch.save(x, tmp_path / "tokens.pt")
    env = dict(
        os.environ,
        PYTHONPATH="",
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        HF_HUB_OFFLINE="1",
    )
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_PURE,
            json.dumps(exports),
            str(tmp_path / "tokens.pt"),
            str(tmp_path / "logits.pt"),
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(tmp_path / "logits.pt")
    for case in CASES:
        torch.testing.assert_close(got[case], want[case], atol=1e-6, rtol=0, msg=lambda m, c=case: f"{c}: {m}")


def test_importing_mcore_rl_hf_imports_no_megatron() -> None:
    """Every module of `mcore_rl.hf`, imported in a fresh interpreter, pulls in no megatron-core and
    none of the packages that need it."""
    script = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import mcore_rl.hf
        for info in pkgutil.iter_modules(mcore_rl.hf.__path__):
            importlib.import_module(f"mcore_rl.hf.{info.name}")
        heavy = ("megatron", "mcore_rl.models", "mcore_rl.parallel", "mcore_rl.train", "mcore_rl.convert")
        print(mcore_rl.hf.__file__)
        print(sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in heavy)))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    where, imported = run.stdout.strip().splitlines()[-2:]
    assert where.startswith(HF_DIR), where
    assert imported == "[]", imported


def _relative_imports(path: str) -> tuple[set[str], list[str]]:
    """(every sibling the module imports at run time, the ones imported inside a function or class body)."""
    tree = ast.parse(open(path, encoding="utf-8").read())

    def siblings(node: ast.AST) -> list[str]:
        if not isinstance(node, ast.ImportFrom) or node.level != 1:
            return []
        return [a.name for a in node.names] if node.module is None else [node.module.split(".")[0]]

    nested = [
        name
        for scope in ast.walk(tree)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        for node in ast.walk(scope)
        for name in siblings(node)
    ]
    # Imports under `if TYPE_CHECKING:` never run: they are annotations, not edges of the import graph.
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    runtime = {name for node in ast.walk(tree) if id(node) not in typing_only for name in siblings(node)}
    return runtime, nested


def test_hf_modules_import_each_other_as_a_dag() -> None:
    """No import cycle between the sibling modules, and no function-level sibling imports to hide one."""
    modules = sorted(name[:-3] for name in os.listdir(HF_DIR) if name.endswith(".py") and name != "__init__.py")
    graph: dict[str, set[str]] = {}
    for name in modules:
        imported, nested = _relative_imports(os.path.join(HF_DIR, f"{name}.py"))
        assert not nested, f"mcore_rl/hf/{name}.py imports {nested} inside a function or class"
        graph[name] = imported & set(modules)
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        if name not in done:
            for dep in graph[name]:
                visit(dep, path + (name,))
            done.add(name)

    for name in modules:
        visit(name, ())
