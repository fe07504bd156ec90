"""The `mcore-rl` command.

    mcore-rl sft [RECIPE.yaml] [key=value ...] [--nproc-per-node N]
    mcore-rl train [RECIPE.yaml] [key=value ...] [--nproc-per-node N]
    mcore-rl rm-train [RECIPE.yaml] [key=value ...] [--nproc-per-node N]
    mcore-rl serve [SGLang launch flags: --model-path, --port, --quantization fp8, ...]
    mcore-rl convert hf-to-mcore --input HF_DIR --output MCORE_DIR [--tp N --pp N --ep N]
    mcore-rl convert mcore-to-hf --input MCORE_CKPT --output HF_DIR
    mcore-rl convert gguf-to-hf --input FILE.gguf --output HF_DIR
    mcore-rl profile MODEL [model.key=value ...] --cluster h100_sxm [--nodes N] [--layout tp=2,pp=2] [--measure]
    mcore-rl plot RUN_DIR [RUN_DIR ...] [--keys k1,k2] [--out PNG]
    mcore-rl parity [RECIPE.yaml] [key=value ...] [--precisions none bf16 fp8] [--engine-url URL] [--json PATH]
    mcore-rl launch --dry-run {sft,train} [RECIPE.yaml] [key=value ...] --nnodes N --nproc-per-node G [--engine-nodes E]

The config is loaded and validated for the world size it will run with *before* any worker starts,
the directories it writes (run_dir, checkpoint.save_dir) are created and probed, and the data files
are read and checked, so a typo, a read-only disk or a bad line costs a second, not a cluster
allocation or a whole run. With `--nproc-per-node N > 1` outside torchrun, the command relaunches
itself under `torch.distributed.run`; under torchrun/SLURM it just runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from mcore_rl.observe import ttfs as _ttfs  # time to first step: the clock starts here

if TYPE_CHECKING:  # annotations only: the config package loads when a command needs it (`--help` stays fast)
    from mcore_rl.config.rl_schema import RLConfig
    from mcore_rl.config.rm_schema import RMConfig
    from mcore_rl.config.schema import SFTConfig

RootConfig = TypeVar("RootConfig", "SFTConfig", "RLConfig", "RMConfig")

PREFLIGHT_DONE = "MCORE_RL_PREFLIGHT_DONE"  # set for the ranks of a relaunch: checked once, before it

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_ENGINES_LOST = 1, 2, 3  # and 75, EXIT_PREEMPTED (parallel/preemption.py)

# The errors a user can act on, by class: one line `mcore-rl COMMAND: message` and this exit code
# instead of a traceback through asyncio or megatron-core. Named, not imported: most live in modules
# a bad recipe never loads (and an error of a module never imported cannot occur); a test checks
# that every name still resolves to an exception class.
EXPECTED_ERRORS: dict[str, int] = {
    "mcore_rl.config.errors.ConfigError": EXIT_BAD_INPUT,
    "mcore_rl.data.files.DataError": EXIT_BAD_INPUT,
    "mcore_rl.rollout.launch_flags.LaunchFlagError": EXIT_BAD_INPUT,
    "builtins.FileNotFoundError": EXIT_BAD_INPUT,
    "mcore_rl.runtime.scheduler.EnginesLost": EXIT_ENGINES_LOST,
    "mcore_rl.rollout.client.EngineUnavailable": EXIT_ENGINES_LOST,  # and NoHealthyEngine (rollout/router.py)
    "mcore_rl.rollout.engine_processes.EngineStartError": EXIT_ENGINES_LOST,
    "mcore_rl.rollout.teacher.TeacherError": EXIT_ENGINES_LOST,
    "mcore_rl.rollout.explorer.ExplorerError": EXIT_ENGINES_LOST,
    "mcore_rl.train.checkpoint.CheckpointError": EXIT_FAILED,
    "mcore_rl.train.weight_sync.WeightSyncError": EXIT_FAILED,
}


# Warnings from inside megatron-core and torch.distributed.checkpoint that name the libraries' own
# calls, so a user can do nothing about them: optional kernels not installed, and four deprecations
# on every model build and checkpoint load (megatron-core 0.16's `load_state_dict`, ShardedTensor twice,
# its cuda-graph scope default).
LIBRARY_WARNINGS = (
    ".*(Transformer Engine|Apex|apex).*",
    ".*ShardedTensor.*",
    ".*`load_state_dict` is deprecated.*",
    ".*full scope is deprecated.*",
)


def expected_exit_code(err: BaseException) -> int | None:
    """The exit code of an expected error (its class or a base class is listed); None for a bug."""
    for cls in type(err).__mro__:
        code = EXPECTED_ERRORS.get(f"{cls.__module__}.{cls.__qualname__}")
        if code is not None:
            return code
    return None


def _world_size(nproc: int) -> int:
    return int(os.environ.get("WORLD_SIZE", nproc))


def _launched() -> bool:
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def _relaunch(nproc: int, cli_args: list[str], cfg=None) -> int:
    """Run `mcore-rl <cli_args>` again as `nproc` local ranks under torchrun; its exit code.

    torchrun gets SIGTERM when this process dies (SIGKILL included) and stops its workers, so
    killing the command the user started stops the whole run. The pre-emption signals of `cfg`
    (`checkpoint.preempt_signals`) go on to the ranks, and their exit code 75 comes back.
    """
    import time

    from mcore_rl.parallel import preemption  # lazy: fast --help
    from mcore_rl.parallel.lifetime import preexec_die_with_parent  # lazy: fast --help

    signals = list(cfg.checkpoint.preempt_signals) if cfg is not None else []
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *(preemption.torchrun_signal_flags(signals) if signals else []),
        "-m",
        "mcore_rl.cli",
        *cli_args,
    ]
    env = dict(os.environ, **{PREFLIGHT_DONE: "1"})
    start = time.time()
    rc = preemption.call_forwarding_signals(command, signals, env=env, preexec_fn=preexec_die_with_parent())
    return preemption.exit_code_after_launch(rc, cfg.run_dir, start) if cfg is not None else rc


def _check_writable(key: str, path: str) -> None:
    """Create the directory `path` and a probe file in it (removed again); a ConfigError naming `key`
    if that fails, so a read-only or misplaced directory fails now rather than at the first save."""
    from mcore_rl.config import ConfigError  # lazy: fast --help

    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is a file, not a directory")
    probe = os.path.join(path, f".mcore_rl_write_probe.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as err:
        where = f" ({err.filename})" if err.filename and os.path.abspath(err.filename) != os.path.abspath(path) else ""
        raise ConfigError(f"{key}: cannot write to {path!r}: {err.strerror or err}{where}") from None


def _preflight(cfg: SFTConfig | RLConfig) -> None:
    """The checks that need the filesystem (validation itself is pure), before any worker starts:
    otherwise they fail after distributed initialisation, or at the first save after training.
    The directories the run writes must be writable; the data files are read and checked (SFT
    examples, RL prompt files), bad lines reported as `file:line: problem` as training would."""
    if os.environ.get(PREFLIGHT_DONE) == "1":
        return
    from mcore_rl.config.rl_schema import RLConfig  # lazy, as the module's others: `--help` stays fast
    from mcore_rl.config.rm_schema import RMConfig  # lazy, likewise

    for key, path in (
        ("run_dir", cfg.run_dir),
        ("checkpoint.save_dir", cfg.checkpoint.save_dir),
        ("rollout.sync_dir", cfg.rollout.sync_dir if isinstance(cfg, RLConfig) else None),
    ):
        if path:
            _check_writable(key, path)
    if isinstance(cfg, RLConfig):
        from mcore_rl.data.prompts import read_prompt_files  # lazy: numpy, only for this command

        read_prompt_files(cfg)
    elif isinstance(cfg, RMConfig):
        if cfg.data.path is not None:
            if cfg.reward_model.objective == "beta_prm":
                from mcore_rl.data.process_rewards import read_process_file  # lazy: torch, only for this command

                read_process_file(cfg.data)
            else:
                from mcore_rl.data.preferences import read_preference_file  # lazy: torch, only for this command

                read_preference_file(cfg.data, cfg.reward_model.objective, cfg.reward_model.num_heads)
    elif cfg.data.path is not None:
        from mcore_rl.data.sft import read_examples  # lazy: torch, only for this command

        read_examples(cfg.data)


def _run_job(
    args: argparse.Namespace,
    name: str,
    root_cls: type[RootConfig],
    validate: Callable[[RootConfig, int], Any],
    entry: str,
) -> int:
    """Load and validate the recipe for the world it will run in, check the files it names; relaunch
    under torchrun or run.

    `entry` ("module:function") is imported only in the process that trains, so a bad recipe fails
    without paying for importing megatron-core.
    """
    import importlib

    from mcore_rl.config import load_config  # lazy: fast --help

    cfg = load_config(root_cls, args.recipe, args.overrides)  # a ConfigError, DataError, ...: one line, exit 2 (main)
    validate(cfg, _world_size(args.nproc_per_node))
    _preflight(cfg)
    _ttfs.mark("config_check")  # time to first step: loading, validating and preflighting the recipe
    if args.nproc_per_node > 1 and not _launched():
        return _relaunch(args.nproc_per_node, [name, *([args.recipe] if args.recipe else []), *args.overrides], cfg)
    from mcore_rl.parallel import setup  # lazy: fast --help
    from mcore_rl.parallel.preemption import EXIT_PREEMPTED, Preempted, preemption_guard  # lazy: fast --help

    module, function = entry.split(":")
    run = getattr(importlib.import_module(module), function)
    with preemption_guard(cfg.checkpoint.preempt_signals, exit_process=True):  # a second signal changes nothing
        try:
            run(cfg)  # EXPECTED_ERRORS (engines lost, a checkpoint not written, ...): one line in main
        except Preempted as err:  # checkpoint written, engines and workers closed (docs/launch.md)
            print(
                f"mcore-rl {name}: {err}; exiting with {EXIT_PREEMPTED} (resume with checkpoint.load_dir)",
                file=sys.stderr,
            )
            return EXIT_PREEMPTED
        finally:
            setup.destroy()
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from mcore_rl.config import SFTConfig, validate_sft_config  # lazy: fast --help

    return _run_job(args, "sft", SFTConfig, validate_sft_config, "mcore_rl.train.sft:run_sft")


def cmd_rm_train(args: argparse.Namespace) -> int:
    from mcore_rl.config.rm_schema import RMConfig  # lazy: fast --help
    from mcore_rl.config.rm_validate import validate_rm_config  # lazy: fast --help

    return _run_job(args, "rm-train", RMConfig, validate_rm_config, "mcore_rl.train.reward_model:run_rm")


def cmd_train(args: argparse.Namespace) -> int:
    from mcore_rl.config import RLConfig, validate_rl_config  # lazy: fast --help

    return _run_job(args, "train", RLConfig, validate_rl_config, "mcore_rl.runtime:run_rl")


def cmd_parity(args: argparse.Namespace) -> int:
    """Engine vs trainer on the same tokens (`mcore_rl.runtime.parity`), one rank."""
    from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config  # lazy: fast --help
    from mcore_rl.data.files import DataError  # lazy: fast --help
    from mcore_rl.runtime.parity import (
        ParityOptions,
        check_options,
        format_report,
        run_parity,
        write_json,
    )  # lazy: fast --help

    opts = ParityOptions(
        precisions=list(args.precisions),
        engine_urls=list(args.engine_url or []),
        num_prompts=args.prompts,
        samples_per_prompt=args.samples,
        position_bins=args.position_bins,
        layers=not args.no_layers,
        checkpoint=args.checkpoint,
        routing_replay=not args.no_routing_replay,
    )
    try:  # everything that can be checked before megatron-core is imported and a policy built
        check_options(opts)
        if args.checkpoint and not os.path.isdir(args.checkpoint):
            raise ConfigError(f"--checkpoint: {args.checkpoint!r} is not a directory")
        cfg = load_config(RLConfig, args.recipe, args.overrides)
        validate_rl_config(cfg, 1)
        _preflight(cfg)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as err:
        print(f"mcore-rl parity: {err}", file=sys.stderr)
        return 2
    from mcore_rl.parallel import setup  # lazy: fast --help

    try:
        report = run_parity(cfg, opts)
    except ValueError as err:
        print(f"mcore-rl parity: {err}", file=sys.stderr)
        return 2
    finally:
        setup.destroy()
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from mcore_rl.config import ConfigError  # lazy: fast --help
    from mcore_rl import convert  # lazy: fast --help

    try:
        _, world = convert.plan(args)  # fails fast, before any worker starts
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"mcore-rl convert {args.direction}: {err}", file=sys.stderr)
        return 2
    if world > 1 and not _launched():
        return _relaunch(world, args.argv)
    return convert.run(args)


def cmd_gguf_to_hf(args: argparse.Namespace) -> int:
    """One process, no torchrun: dequantise a GGUF file into an HF checkpoint directory."""
    from mcore_rl.convert.gguf import gguf_to_hf, inspect_gguf  # lazy: fast --help

    try:
        inspect_gguf(args.input)
        if os.path.exists(args.output) and os.listdir(args.output):
            raise FileExistsError(f"--output {args.output} is not empty")
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"mcore-rl convert gguf-to-hf: {err}", file=sys.stderr)
        return 2
    summary = gguf_to_hf(args.input, args.output)
    print(
        f"wrote {args.output}: {summary['model_type']} with {summary['parameters']:,} parameters "
        f"(float32), tokenizer{' with chat template' if summary['chat_template'] else ''}, generation config"
    )
    return 0


def _add_convert_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    convert = sub.add_parser("convert", help=help_text)
    directions = convert.add_subparsers(dest="direction", required=True)
    gguf = directions.add_parser("gguf-to-hf", help="GGUF file (Llama, Qwen3, Qwen3-MoE) -> float32 HF checkpoint dir")
    gguf.add_argument("--input", required=True, help="the .gguf file")
    gguf.add_argument("--output", required=True, help="target directory (new or empty)")
    gguf.set_defaults(func=cmd_gguf_to_hf)
    for name, help_text in [
        ("hf-to-mcore", "HF checkpoint dir (Qwen3, Qwen3-MoE, Llama) -> megatron dist-checkpoint (model only)"),
        ("mcore-to-hf", "megatron dist-checkpoint -> HF checkpoint dir (stock class, or remote code)"),
    ]:
        p = directions.add_parser(name, help=help_text)
        p.add_argument("--input", required=True, help="source directory")
        p.add_argument("--output", required=True, help="target directory")
        p.add_argument("--tp", type=int, default=1, help="tensor parallel size to convert in")
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to convert in")
        p.add_argument("--ep", type=int, default=1, help="expert parallel size to convert in")
        p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
        p.add_argument(
            "--nproc-per-node", type=int, default=None, help="ranks to launch (default: the fewest the layout needs)"
        )
        p.set_defaults(func=cmd_convert)
        if name == "hf-to-mcore":
            p.add_argument(
                "--precision",
                choices=["fp32", "bf16"],
                default="fp32",
                help="dtype of the stored megatron weights (fp32 holds bf16 sources exactly)",
            )
        else:
            p.add_argument(
                "--dtype",
                choices=["auto", "fp32", "bf16", "fp16"],
                default="auto",
                help="HF weight dtype (auto: the converted source's, else as stored)",
            )
            p.add_argument(
                "--config", default=None, help="recipe with the model config, for checkpoints that do not record it"
            )
            p.add_argument("overrides", nargs="*", help="dotted overrides of --config, e.g. model.num_layers=4")
            p.add_argument(
                "--tokenizer",
                default=None,
                help="directory whose tokenizer files to copy (default: the checkpoint's hf_assets/)",
            )
            p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB)")


def cmd_diagnose(args: argparse.Namespace) -> int:
    """One analysis of a run or its checkpoints (`mcore_rl.diagnose`): its table, and JSON on request."""
    import json

    from mcore_rl.config import ConfigError  # lazy: fast --help
    from mcore_rl.diagnose.report import format_table  # lazy: fast --help

    try:
        result = args.run_analysis(args)
    except (ConfigError, FileNotFoundError, ValueError, KeyError) as err:
        print(f"mcore-rl diagnose {args.analysis}: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
        print(f"wrote {args.json}")
    return 0


def _add_diagnose_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    from mcore_rl.diagnose import analyses  # lazy: fast --help

    diagnose = sub.add_parser("diagnose", help=help_text)
    which = diagnose.add_subparsers(dest="analysis", required=True)
    for name, a in analyses().items():
        p = which.add_parser(name, help=a.help)
        p.add_argument("--json", help="also write the numbers to this JSON file")
        p.set_defaults(func=cmd_diagnose, run_analysis=a.add_arguments(p), usage=p.format_usage)


def cmd_profile(args: argparse.Namespace) -> int:
    """Parallel layouts (and the RL GPU split) estimated for a cluster (`mcore_rl.profile`)."""
    from mcore_rl.config import ConfigError  # lazy: fast --help
    from mcore_rl.profile import command  # lazy: fast --help

    try:
        print(command.run(args))
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"mcore-rl profile: {err}", file=sys.stderr)
        return 2
    return 0


def _add_plot_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    from mcore_rl.observe import plot  # lazy: fast --help

    p = sub.add_parser("plot", help=help_text, usage="mcore-rl plot RUN_DIR [RUN_DIR ...] [--keys k1,k2] [--out PNG]")
    plot.add_arguments(p)
    p.set_defaults(func=plot.main, usage=p.format_usage)


def cmd_serve(argv: list[str]) -> int:
    """The embedded SGLang-compatible engine; flags as `python -m sglang.launch_server` takes them."""
    import logging

    from mcore_rl.rollout.launch_flags import LaunchFlagError, parse_server_args  # lazy: fast --help

    try:
        args = parse_server_args(argv)
    except LaunchFlagError as err:
        print(f"mcore-rl serve: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mcore_rl.rollout.server import build_server, run_server  # lazy: fast --help

    try:
        server = build_server(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"mcore-rl serve: {err}", file=sys.stderr)
        return 2
    run_server(server, args.host, args.port)
    return 0


_DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _recipe_or_override(args: argparse.Namespace) -> str | None:
    """Sort out a first positional that is no recipe file. `mcore-rl train rollout.group_size=4`
    has no recipe: containing "=", it is the first override. One that looks like a dotted key
    without "=" (`rollout.group_size 4`, `rollout.group_size:4`) is a mistyped override: the message
    to print (else None)."""
    recipe = getattr(args, "recipe", None)
    if not recipe or os.path.isfile(recipe):
        return None
    if "=" in recipe:
        args.overrides.insert(0, recipe)
        args.recipe = None
        return None
    key, _, value = recipe.partition(":")
    if recipe.endswith((".yaml", ".yml")) or not _DOTTED_KEY.fullmatch(key.strip()):
        return None  # a recipe path: the loader reports it missing
    if not value and args.overrides and "=" not in args.overrides[0]:
        value = args.overrides[0]
    return (
        f"{recipe!r} is not a recipe file; it looks like an override, and overrides are written key=value "
        f"(e.g. {key.strip()}={value.strip() or 'VALUE'})"
    )


def _add_sft(sub: argparse._SubParsersAction, help_text: str) -> None:
    sft = sub.add_parser(
        "sft", help=help_text, usage="mcore-rl sft [RECIPE.yaml] [key.path=value ...] [--nproc-per-node N]"
    )
    sft.add_argument("recipe", nargs="?", help="YAML recipe (configs/*.yaml); defaults if omitted")
    sft.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.train_iters=50")
    sft.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine")
    sft.set_defaults(func=cmd_sft, usage=sft.format_usage)


def _add_rm_train(sub: argparse._SubParsersAction, help_text: str) -> None:
    rm = sub.add_parser(
        "rm-train", help=help_text, usage="mcore-rl rm-train [RECIPE.yaml] [key.path=value ...] [--nproc-per-node N]"
    )
    rm.add_argument("recipe", nargs="?", help="YAML recipe (configs/rm_demo.yaml); defaults if omitted")
    rm.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward_model.objective=binary")
    rm.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine")
    rm.set_defaults(func=cmd_rm_train, usage=rm.format_usage)


def _add_train(sub: argparse._SubParsersAction, help_text: str) -> None:
    train = sub.add_parser(
        "train", help=help_text, usage="mcore-rl train [RECIPE.yaml] [key.path=value ...] [--nproc-per-node N]"
    )
    train.add_argument("recipe", nargs="?", help="YAML recipe (configs/demo.yaml); defaults if omitted")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.num_steps=20")
    train.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine")
    train.set_defaults(func=cmd_train, usage=train.format_usage)


def _add_parity(sub: argparse._SubParsersAction, help_text: str) -> None:
    parity = sub.add_parser(
        "parity",
        help=help_text,
        usage="mcore-rl parity [RECIPE.yaml] [key.path=value ...] [--precisions none bf16 fp8] "
        "[--engine-url URL] [--json PATH]",
    )
    parity.add_argument("recipe", nargs="?", help="YAML recipe (configs/demo.yaml); defaults if omitted")
    parity.add_argument("overrides", nargs="*", help="dotted overrides, e.g. init.sft_steps=0")
    parity.add_argument(
        "--precisions",
        nargs="*",
        default=["none", "bf16", "fp8"],
        help="embedded engines to compare: none (fp32), bf16, fp8; the first one samples the sequences",
    )
    parity.add_argument("--engine-url", action="append", help="an SGLang-compatible server to compare too (repeatable)")
    parity.add_argument(
        "--checkpoint", help="weights to compare (a megatron checkpoint dir) instead of the recipe's init"
    )
    parity.add_argument("--prompts", type=int, default=16, help="training prompts to sample from")
    parity.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parity.add_argument(
        "--position-bins", type=int, default=16, help="response positions per bin of the by-position table"
    )
    parity.add_argument("--no-layers", action="store_true", help="skip the per-layer hidden-state / routing report")
    parity.add_argument(
        "--no-routing-replay",
        action="store_true",
        help="MoE: skip scoring with each engine's routing replayed in the trainer (R3)",
    )
    parity.add_argument("--json", help="also write the numbers to this JSON file")
    parity.set_defaults(func=cmd_parity, usage=parity.format_usage)


def _add_profile(sub: argparse._SubParsersAction, help_text: str) -> None:
    from mcore_rl.profile.command import add_arguments as add_profile_arguments  # lazy: fast --help

    profile = sub.add_parser("profile", help=help_text)
    add_profile_arguments(profile)
    profile.set_defaults(func=cmd_profile, usage=profile.format_usage)


def _add_launch(sub: argparse._SubParsersAction, help_text: str) -> None:
    from mcore_rl.parallel.launch_plan import add_launch_parser  # lazy: fast --help

    add_launch_parser(sub)  # launch: `mcore-rl launch --dry-run` (its help line is its own)


def _add_serve(sub: argparse._SubParsersAction, help_text: str) -> None:
    # `serve` is parsed by mcore_rl.rollout.launch_flags (SGLang's flag names); listed here for --help.
    sub.add_parser("serve", add_help=False, help=help_text)


# name -> (one-line help, what adds its arguments). Only the command being run gets its arguments:
# some of them (diagnose's analyses, profile's estimators) import torch, and `mcore-rl --help` or a
# typo in a recipe should not pay seconds for that.
COMMANDS: dict[str, tuple[str, Callable[[argparse._SubParsersAction, str], None]]] = {
    "sft": ("supervised training of a megatron-core model", _add_sft),
    "train": ("RL: rollouts from the engine(s), rewards, policy updates, weight sync", _add_train),
    "rm-train": ("reward-model training: a value head on the decoder, from preference pairs or labels", _add_rm_train),
    "convert": ("Hugging Face <-> megatron-core checkpoint conversion", _add_convert_parser),
    "parity": ("engine vs trainer log-probs, hidden states and MoE routing on the same tokens", _add_parity),
    "diagnose": ("analyses of a run or its checkpoints (one per paper)", _add_diagnose_parser),
    "profile": ("estimate parallel layouts and the RL train/inference GPU split", _add_profile),
    "plot": ("PNG curves of one or several runs' metrics.jsonl, side by side", _add_plot_parser),
    "launch": ("the plan of a torchrun/SLURM launch: nodes, ranks, groups, engines (--dry-run)", _add_launch),
    "serve": ("the embedded SGLang-compatible inference server (SGLang's flags)", _add_serve),
}

EXIT_CODES_HELP = """exit codes:
  0   finished
  1   failed: an error in training (a checkpoint that could not be written, a weight sync, a bug)
  2   bad input: config, files, flags, a layout the world cannot hold; nothing was started
  3   inference engines lost: none could be started or reached (rollout, teachers, explorer)
  75  pre-empted by a signal: checkpoint written, resume with checkpoint.load_dir

An expected error is one line `mcore-rl COMMAND: message`; --debug (or MCORE_RL_DEBUG=1) also prints
its traceback. An unexpected one (a bug) always prints its traceback."""


def _command_of(argv: list[str]) -> str | None:
    """The command named on the command line (its first word that is not an option), if it is one."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(commands: Iterable[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """Every command with its help line, and the arguments of `commands` (`main` asks for the one
    being run, none for `mcore-rl --help`)."""
    parser = argparse.ArgumentParser(
        prog="mcore-rl",
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of expected errors too (also MCORE_RL_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add) in COMMANDS.items():
        if name in commands:
            add(sub, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    for message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("MCORE_RL_DEBUG", "0") not in ("", "0")
    command = _command_of(argv)
    if command != "serve" and "--debug" in argv:
        debug, argv = True, [word for word in argv if word != "--debug"]
        os.environ["MCORE_RL_DEBUG"] = "1"  # and so for the ranks of a relaunch under torchrun
    try:
        if command == "serve":
            return cmd_serve(argv[argv.index("serve") + 1 :])
        parser = build_parser([command] if command else [])
        args = parser.parse_args(argv)
        problem = _recipe_or_override(args)
        if problem:
            print(f"mcore-rl {args.command}: {problem}\n{args.usage()}", file=sys.stderr, end="")
            return EXIT_BAD_INPUT
        args.argv = argv  # `convert` relaunches itself under torchrun with the same arguments
        return args.func(args)
    except Exception as err:
        code = expected_exit_code(err)
        if code is None:
            raise  # a bug: its traceback
        if debug:
            traceback.print_exc()
        print(f"mcore-rl {command}: {err}" if command else f"mcore-rl: {err}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
