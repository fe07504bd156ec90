"""The package structure, checked: arrows of the data flow that must never exist (docs/architecture.md).

Every `import` in a package's files counts, including those inside functions (a lazy import is
still a dependency). A second check imports the packages that must stay light in a fresh
interpreter and looks at what came along.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mcore_rl"

# package -> module prefixes it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # pure tensor functions: no Megatron, no HTTP, nothing of the trainer or the engines
    "algos": (
        "megatron",
        "aiohttp",
        "mcore_rl.models",
        "mcore_rl.parallel",
        "mcore_rl.rollout",
        "mcore_rl.train",
        "mcore_rl.runtime",
        "mcore_rl.data",
        "mcore_rl.rewards",
        "mcore_rl.convert",
    ),
    # exported as remote code and used by the engine: never Megatron
    "hf": (
        "megatron",
        "mcore_rl.models",
        "mcore_rl.parallel",
        "mcore_rl.train",
        "mcore_rl.runtime",
        "mcore_rl.rollout",
        "mcore_rl.convert",
    ),
    # the engine side knows nothing of the learner or the loop
    "rollout": ("mcore_rl.train", "mcore_rl.runtime", "mcore_rl.convert", "mcore_rl.rewards"),
    "rewards": (
        "megatron",
        "mcore_rl.train",
        "mcore_rl.runtime",
        "mcore_rl.rollout",
        "mcore_rl.data",
        "mcore_rl.models",
        "mcore_rl.parallel.setup",
        "mcore_rl.parallel.cpu_compat",
    ),
    "models": ("mcore_rl.rollout", "mcore_rl.train", "mcore_rl.runtime", "mcore_rl.convert"),
    "parallel": ("mcore_rl.models", "mcore_rl.train", "mcore_rl.rollout", "mcore_rl.runtime", "mcore_rl.convert"),
    "data": (
        "megatron",
        "mcore_rl.train",
        "mcore_rl.runtime",
        "mcore_rl.rollout",
        "mcore_rl.models",
        "mcore_rl.parallel",
        "mcore_rl.convert",
    ),
    "train": ("mcore_rl.runtime", "mcore_rl.convert"),
    # interactive tasks and their tools: they may use `data` (prompts, tasks, tool calls) and `rewards`
    # (the sandbox, the scorers), nothing of the engines, the learner or the loop that runs them
    "envs": (
        "megatron",
        "aiohttp",
        "mcore_rl.rollout",
        "mcore_rl.train",
        "mcore_rl.runtime",
        "mcore_rl.models",
        "mcore_rl.parallel.setup",
        "mcore_rl.parallel.cpu_compat",
        "mcore_rl.convert",
        "mcore_rl.config",
    ),
    # metrics, timers, MFU, profiles: under both `train` (SFT) and `runtime` (the RL loop)
    "observe": (
        "megatron",
        "mcore_rl.train",
        "mcore_rl.runtime",
        "mcore_rl.rollout",
        "mcore_rl.convert",
        "mcore_rl.data",
        "mcore_rl.rewards",
        "mcore_rl.parallel",
    ),
    "config": (
        "megatron",
        "mcore_rl.train",
        "mcore_rl.runtime",
        "mcore_rl.rollout",
        "mcore_rl.models",
        "mcore_rl.parallel",
        "mcore_rl.convert",
    ),
    # multi-turn episodes: after the engines' side, before the learner (agent programs die with the
    # trainer through `parallel.lifetime`, as an environment's child process does)
    "agent": (
        "megatron",
        "mcore_rl.models",
        "mcore_rl.parallel.setup",
        "mcore_rl.parallel.cpu_compat",
        "mcore_rl.train",
        "mcore_rl.runtime",
        "mcore_rl.convert",
    ),
}
# the packages above `agent` in the data flow never import it
for _package in ("algos", "hf", "rollout", "rewards", "models", "parallel", "data", "observe", "config"):
    FORBIDDEN[_package] = FORBIDDEN[_package] + ("mcore_rl.agent",)
# `envs` sits below `data` and `rewards` in the data flow: none of the packages above it imports it
for _package in ("algos", "hf", "rewards", "data", "models", "parallel", "observe"):
    FORBIDDEN[_package] = FORBIDDEN[_package] + ("mcore_rl.envs",)
# analyses of finished runs (`mcore-rl diagnose`) sit below everything: only the command imports them
for _package in list(FORBIDDEN) + ["runtime", "convert"]:
    FORBIDDEN[_package] = FORBIDDEN.get(_package, ()) + ("mcore_rl.diagnose",)
# `mcore-rl profile` likewise: it reads every layer above it, none reads it
for _package in list(FORBIDDEN) + ["diagnose"]:
    FORBIDDEN[_package] = FORBIDDEN.get(_package, ()) + ("mcore_rl.profile",)
# the recipes (paper methods as plug-ins, `mcore_rl/hooks.py`) sit below the core: the core finds
# them through `hooks.registered()` at run time and imports none of them
for _package in list(FORBIDDEN) + ["runtime", "convert", "diagnose", "profile"]:
    FORBIDDEN[_package] = FORBIDDEN.get(_package, ()) + ("mcore_rl.recipes",)
# the core files a new method must not need to touch, and the words that would say it did
CORE_FILES = (
    "runtime/loop.py",
    "runtime/rollout_manager.py",
    "runtime/scheduler.py",
    "runtime/rollouts.py",
    "train/rl_step.py",
    "config/rl_schema.py",
    "config/rl_validate.py",
    "config/loader.py",
    "config/sections.py",
    "config/rl_recipes.py",
    "hooks.py",
)
RECIPE_WORDS = ("mipu", "effopd", "polaris", "s2l", "gec", "remath", "re-math", "exprl", "rlcer", "explorer", "appo")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: pathlib.Path, package: str = "") -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved against
    `package` (default: the file's own package in the tree)."""
    tree = ast.parse(path.read_text(), str(path))
    if not package:
        package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{a.name}") for a in node.names if module == "mcore_rl"]
    return out


def _banned(module: str, banned: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in banned)


def _violations(package: str, banned: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line, module in imports_of(path)
        if _banned(module, banned)
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_arrow(package: str) -> None:
    assert (PACKAGE / package).is_dir(), f"mcore_rl/{package} is gone: update FORBIDDEN"
    assert _violations(package, FORBIDDEN[package]) == []


def test_top_level_modules_import_no_recipe() -> None:
    """`hooks.py` (the protocol), `progress.py`, `cli.py`: no recipe module either."""
    found = [
        f"{p.name}:{line}: imports {m}"
        for p in sorted(PACKAGE.glob("*.py"))
        for line, m in imports_of(p, "mcore_rl")
        if _banned(m, ("mcore_rl.recipes",))
    ]
    assert found == []


@pytest.mark.parametrize("name", CORE_FILES)
def test_core_names_no_recipe(name: str) -> None:
    """Adding a method touches its own module in `recipes/` and its registration, not the core:
    the core's code and comments name no paper method."""
    text = (PACKAGE / name).read_text().lower()
    words = [w for w in RECIPE_WORDS if re.search(rf"\b{re.escape(w)}", text)]
    assert words == [], f"mcore_rl/{name} names {words}: move the method behind its recipe's hooks"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: pathlib.Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\ndef f():\n    from megatron.core import parallel_state\n    from ..train import sft\n"
    )
    found = [m for _, m in imports_of(probe, package="mcore_rl.hf")]
    assert found == ["torch", "megatron.core", "mcore_rl.train"]
    assert [m for m in found if _banned(m, FORBIDDEN["hf"])] == ["megatron.core", "mcore_rl.train"]


def test_recipe_config_sections_load_without_the_recipes() -> None:
    """Loading a config reads the recipes' sections (`recipes/config/`) and the model's
    (`config/model_keys/`) by name; that import stays light: no torch, no recipe machinery, no model
    bundle, so `load_config` costs what it did before."""
    script = (
        "import sys\n"
        "from mcore_rl.config import RLConfig, load_config\n"
        "load_config(RLConfig, None, ['rollout.polaris.rescue=true', 'algorithm.mismatch.mipu_z=1',\n"
        "    'model.arch=deepseek_v3', 'model.q_lora_rank=16', 'model.num_experts=4', 'model.ngram.orders=[2]'])\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'aiohttp')\n"
        "    or m.startswith(('mcore_rl.hf', 'mcore_rl.models'))\n"
        "    or m.startswith('mcore_rl.recipes.') and not m.startswith('mcore_rl.recipes.config'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_light_packages_import_without_megatron_or_http() -> None:
    script = (
        "import sys\n"
        "import mcore_rl.algos, mcore_rl.hf, mcore_rl.rewards, mcore_rl.data.tasks, mcore_rl.data.prompts, mcore_rl.envs\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('megatron', 'aiohttp')})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
