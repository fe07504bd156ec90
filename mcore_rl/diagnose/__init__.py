"""`mcore-rl diagnose <analysis>`: analyses of a finished run or of its checkpoints, one module per
paper (docs/papers.md).

Each analysis computes its paper's central quantity on what a run leaves behind (the run directory's
metrics, two checkpoints, saved rollouts) and prints it as a table (and JSON with `--json`). It is
registered with `@analysis(name, help)` on a function `add_arguments(parser)` returning the function
that runs it: `run(args) -> dict` (the numbers, which the command prints and optionally writes).
Nothing here is imported by the trainer; an analysis may import any package of the project.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

Runner = Callable[[argparse.Namespace], dict[str, Any]]
AddArguments = Callable[[argparse.ArgumentParser], Runner]


@dataclass(frozen=True)
class Analysis:
    name: str
    help: str
    add_arguments: AddArguments


_ANALYSES: dict[str, Analysis] = {}
# the modules that register analyses, imported when the command line is built
MODULES: tuple[str, ...] = ("remath", "sgd_vs_adam", "update_sparsity", "verif_horizon", "vgh")


def analysis(name: str, help: str) -> Callable[[AddArguments], AddArguments]:
    """Decorator: register `add_arguments` as the analysis `name`; two modules cannot share a name."""

    def deco(fn: AddArguments) -> AddArguments:
        if name in _ANALYSES and _ANALYSES[name].add_arguments is not fn:
            raise ValueError(f"analysis {name!r} is already registered ({_ANALYSES[name].add_arguments.__module__})")
        _ANALYSES[name] = Analysis(name, help, fn)
        return fn

    return deco


def analyses() -> dict[str, Analysis]:
    """Every registered analysis, by name (importing the modules that register them)."""
    for module in MODULES:
        importlib.import_module(f"mcore_rl.diagnose.{module}")
    return dict(sorted(_ANALYSES.items()))
