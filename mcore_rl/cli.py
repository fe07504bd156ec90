"""The `mcore-rl` command.

    mcore-rl sft [RECIPE.yaml] [key=value ...] [--nproc-per-node N]

The config is loaded and validated for the world size it will run with *before* any worker starts,
so a typo costs a second, not a cluster allocation. With `--nproc-per-node N > 1` outside torchrun,
the command relaunches itself under `torch.distributed.run`; under torchrun/SLURM it just runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from typing import Optional


def _world_size(nproc: int) -> int:
    return int(os.environ.get("WORLD_SIZE", nproc))


def _launched() -> bool:
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def cmd_sft(args: argparse.Namespace) -> int:
    from mcore_rl.config import ConfigError, SFTConfig, load_config, validate_sft_config

    try:
        cfg = load_config(SFTConfig, args.recipe, args.overrides)
        validate_sft_config(cfg, _world_size(args.nproc_per_node))
    except (ConfigError, FileNotFoundError) as err:
        print(f"mcore-rl sft: {err}", file=sys.stderr)
        return 2
    if args.nproc_per_node > 1 and not _launched():
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.nproc_per_node}", "-m", "mcore_rl.cli", "sft",
            *([args.recipe] if args.recipe else []), *args.overrides,
        ]
        return subprocess.call(command)
    from mcore_rl.parallel import setup
    from mcore_rl.train.sft import run_sft

    try:
        run_sft(cfg)
    finally:
        setup.destroy()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-rl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sft = sub.add_parser("sft", help="supervised training of a megatron-core model")
    sft.add_argument("recipe", nargs="?", help="YAML recipe (configs/*.yaml); defaults if omitted")
    sft.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.train_iters=50")
    sft.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine")
    sft.set_defaults(func=cmd_sft)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # `mcore-rl sft train.x=1` has no recipe: a first positional containing "=" is an override.
    if getattr(args, "recipe", None) and "=" in args.recipe and not args.recipe.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.recipe)
        args.recipe = None
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
