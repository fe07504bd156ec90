"""The plan of a cluster launch, `mcore-rl launch --dry-run` (docs/launch.md): what would run where.

For a recipe and a cluster shape (trainer nodes x ranks per node, optional engine nodes) the plan
says which node hosts which global ranks, the TP/PP/DP/CP/EP/ETP/EDP process group of every rank,
the c10d rendezvous endpoint, where the inference servers go, their ports and URLs, the router in
front of them and the overrides the trainer gets (`rollout.engine_urls`, `checkpoint.load_dir` when
resuming), without starting anything. It validates the recipe for the world size first (the
trainer's own rules) and, inside a SLURM allocation, that the allocation holds the layout.

The process groups come from megatron-core's `RankGenerator` with the order
`initialize_model_parallel` uses by default, as `parallel/setup.py: init_model_parallel` does:
the same arithmetic the trainer's ranks run, not a second copy.

`launch/slurm.sbatch` reads the plan as shell variables (`--emit shell`), so the batch script,
the dry run and the checks are one code path.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from mcore_rl.config import ConfigError
from mcore_rl.config.rules import expert_tensor_parallel_size
from mcore_rl.config.speculative import NEEDS_DRAFT_MODEL, sglang_speculative_flags, speculative_shape_errors
from mcore_rl.parallel.preemption import torchrun_signal_flags
from mcore_rl.config import RLConfig, SFTConfig, load_config
from mcore_rl.config import validate_rl_config, validate_sft_config

GROUPS = ("tp", "pp", "dp", "cp", "ep", "etp", "edp")  # edp: the expert-data-parallel group


@dataclass
class Allocation:
    """What a SLURM job was given (from its SLURM_* environment and `scontrol show hostnames`)."""

    job_id: str
    nodes: int
    gpus_per_node: int | None  # None: the job did not ask for GPUs
    hosts: list[str]


@dataclass
class LaunchRequest:
    mode: str  # "sft" or "train"
    nnodes: int  # trainer nodes
    nproc_per_node: int  # trainer ranks (GPUs) per node
    engine_nodes: int = 0  # nodes that run inference servers (train only)
    engines_per_node: int = 1  # servers per engine node; each gets gpus_per_node / engines_per_node GPUs
    gpus_per_node: int | None = None  # engine nodes' GPUs (default: the allocation's, else nproc_per_node)
    engine_model: str | None = None  # the HF checkpoint the servers start from (weights then come by sync)
    hosts: list[str] = field(default_factory=list)  # node names in order (default: the allocation's)
    master_addr: str | None = None  # rendezvous host (default: the first trainer node)
    master_port: int = 29500
    engine_port: int = 30000  # first server's port on each engine node; the next ones count up
    router_port: int = 30080
    resume: bool = False  # add checkpoint.load_dir=<save_dir> when save_dir holds a checkpoint


@dataclass
class Plan:
    mode: str
    world_size: int
    sizes: dict[str, Any]  # tp, pp, vpp, cp, ep, etp, dp, edp
    trainer_hosts: list[str]
    nproc_per_node: int
    rendezvous: str  # host:port of the c10d store (the first trainer node)
    engine_hosts: list[str]
    engines: list[dict[str, Any]]  # host, port, url, gpus (CUDA_VISIBLE_DEVICES), tp
    router: dict[str, Any]  # kind ("sglang-router", "mcore-rl", "embedded"), url, where
    trainer_overrides: list[str]
    ranks: list[dict[str, Any]]  # rank, node, host, local_rank, and one rank list per group
    run_dir: str
    preempt_signals: list[str]  # checkpoint.preempt_signals: what the launchers pass on to the trainer
    allocation: dict[str, Any] | None = None
    engine_spec_args: list[str] = field(default_factory=list)  # SGLang's --speculative-* (ENGINE_SPEC_ARGS)


def slurm_allocation(env: dict[str, str] | None = None) -> Allocation | None:
    """The current SLURM job's nodes and GPUs, or None outside a job."""
    env = dict(os.environ) if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    gpus = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE")  # "8", or "h100:8" on some sites
    hosts: list[str] = []
    if env.get("SLURM_JOB_NODELIST"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            hosts = out.split()
        except (OSError, subprocess.SubprocessError) as err:
            raise ConfigError(
                f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r}: `scontrol show hostnames` failed: {err}"
            ) from None
    return Allocation(env["SLURM_JOB_ID"], nodes, int(gpus.rsplit(":", 1)[-1]) if gpus else None, hosts)


def check_allocation(req: LaunchRequest, alloc: Allocation) -> None:
    """The layout must fit the job: a ConfigError naming both sets of numbers otherwise."""
    need = req.nnodes + req.engine_nodes
    problems = []
    if need > alloc.nodes:
        problems.append(
            f"it needs {need} node(s) ({req.nnodes} trainer + {req.engine_nodes} engine) but the "
            f"allocation has {alloc.nodes}"
        )
    if alloc.gpus_per_node is not None and req.nproc_per_node > alloc.gpus_per_node:
        problems.append(
            f"it needs {req.nproc_per_node} GPU(s) per trainer node (--nproc-per-node) but the "
            f"allocation has {alloc.gpus_per_node} per node"
        )
    if problems:
        raise ConfigError(
            f"the SLURM allocation (job {alloc.job_id}: {alloc.nodes} node(s) x "
            f"{alloc.gpus_per_node if alloc.gpus_per_node is not None else 'no'} GPU(s)) cannot hold "
            f"this plan: " + "; ".join(problems)
        )


def _check_request(req: LaunchRequest) -> None:
    bad = [
        f"{name} must be >= {low}, got {value}"
        for name, value, low in (
            ("--nnodes", req.nnodes, 1),
            ("--nproc-per-node", req.nproc_per_node, 1),
            ("--engine-nodes", req.engine_nodes, 0),
            ("--engines-per-node", req.engines_per_node, 1),
        )
        if value < low
    ]
    if req.mode not in ("sft", "train"):
        bad.append(f"mode must be sft or train, got {req.mode!r}")
    if req.engine_nodes and req.mode != "train":
        bad.append("--engine-nodes is for `train` (SFT starts no inference servers)")
    if req.engine_nodes and not req.engine_model:
        bad.append("--engine-model (ENGINE_MODEL): the HF checkpoint the inference servers start from")
    gpus = req.gpus_per_node or req.nproc_per_node
    if req.engine_nodes and gpus % req.engines_per_node:
        bad.append(f"--engines-per-node {req.engines_per_node} does not divide the {gpus} GPU(s) of an engine node")
    if bad:
        raise ConfigError("launch: " + "; ".join(bad))


def _rank_groups(world: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> list[dict[str, list[int]]]:
    """Each rank's groups, from megatron-core's RankGenerator in initialize_model_parallel's order."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")  # as `mcore-rl` does
    from megatron.core.parallel_state import RankGenerator, initialize_model_parallel

    order = inspect.signature(initialize_model_parallel).parameters["order"].default
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    tokens = {
        "tp": (dense, "tp"),
        "pp": (dense, "pp"),
        "dp": (dense, "dp"),
        "cp": (dense, "cp"),
        "ep": (expert, "ep"),
        "etp": (expert, "tp"),
        "edp": (expert, "dp"),
    }
    out: list[dict[str, list[int]]] = [{} for _ in range(world)]
    for name, (gen, token) in tokens.items():
        for ranks in gen.get_ranks(token):
            for r in ranks:
                out[r][name] = list(ranks)
    return out


def _load(req: LaunchRequest, recipe: str | None, overrides: list[str]) -> Any:
    return load_config(RLConfig if req.mode == "train" else SFTConfig, recipe, overrides)


def make_plan(
    req: LaunchRequest,
    recipe: str | None,
    overrides: list[str],
    *,
    groups: bool = True,
    allocation: Allocation | None = None,
) -> Plan:
    """Everything `mcore-rl launch --dry-run` prints; ConfigError for a layout that cannot run."""

    _check_request(req)
    if allocation is not None:
        check_allocation(req, allocation)
    total = req.nnodes + req.engine_nodes
    hosts = list(req.hosts or (allocation.hosts if allocation is not None else []))
    if not hosts:
        hosts = ["127.0.0.1"] if total == 1 else [f"node{i}" for i in range(total)]
    if len(hosts) < total:
        raise ConfigError(
            f"launch: {total} node(s) needed ({req.nnodes} trainer + {req.engine_nodes} engine), "
            f"only {len(hosts)} host name(s) given: {hosts}"
        )
    trainer_hosts, engine_hosts = hosts[: req.nnodes], hosts[req.nnodes : total]
    gpus = (
        req.gpus_per_node
        or (allocation.gpus_per_node if allocation and allocation.gpus_per_node else None)
        or req.nproc_per_node
    )
    engines: list[dict[str, Any]] = []
    router: dict[str, Any]
    per_engine = gpus // req.engines_per_node
    for host in engine_hosts:
        for i in range(req.engines_per_node):
            port = req.engine_port + i
            engines.append(
                {
                    "host": host,
                    "port": port,
                    "url": f"http://{host}:{port}",
                    "tp": per_engine,
                    "gpus": ",".join(str(g) for g in range(i * per_engine, (i + 1) * per_engine)),
                }
            )
    overrides = list(overrides)
    extra: list[str] = []
    spec_args: list[str] = []
    if engines:
        if importlib.util.find_spec("sglang_router") is not None:
            router = {
                "kind": "sglang-router",
                "url": f"http://{engine_hosts[0]}:{req.router_port}",
                "where": engine_hosts[0],
            }
            urls = [router["url"]]
        else:  # the trainer's own EngineRouter (rollout/router.py) spreads requests over every server
            router = {"kind": "mcore-rl", "url": None, "where": "trainer (global rank 0)"}
            urls = [e["url"] for e in engines]
        extra.append(f"rollout.engine_urls=[{','.join(urls)}]")
        if req.mode == "train":
            spec_args, spec_extra = _server_speculation(_load(req, recipe, overrides).rollout)
            extra += spec_extra
    else:
        router = {
            "kind": "embedded" if req.mode == "train" else "none",
            "url": None,
            "where": f"global rank 0 ({trainer_hosts[0]})" if req.mode == "train" else "-",
        }
    cfg = _load(req, recipe, overrides + extra)
    if req.mode == "train" and not engines and cfg.rollout.engine_urls:
        router = {
            "kind": "mcore-rl",
            "url": None,
            "where": "trainer (global rank 0), rollout.engine_urls of the recipe",
        }
    world = req.nnodes * req.nproc_per_node
    validate = validate_rl_config if req.mode == "train" else validate_sft_config
    try:
        validate(cfg, world)
    except ConfigError as err:
        raise ConfigError(
            f"the recipe cannot run on world size {world} ({req.nnodes} node(s) x {req.nproc_per_node} rank(s)): {err}"
        ) from None
    ck = cfg.checkpoint
    if req.resume and ck.save_dir and not ck.load_dir and os.path.exists(os.path.join(ck.save_dir, "latest")):
        extra.append(f"checkpoint.load_dir={ck.save_dir}")
    p = cfg.parallel
    tp, pp, cp, ep = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
        p.expert_model_parallel_size,
    )
    etp = expert_tensor_parallel_size(p)
    sizes = {
        "tp": tp,
        "pp": pp,
        "vpp": p.virtual_pipeline_model_parallel_size,
        "cp": cp,
        "dp": world // (tp * pp * cp),
        "ep": ep,
        "etp": etp,
        "edp": world // (etp * ep * pp),
    }
    per_rank = _rank_groups(world, tp, pp, cp, ep, etp) if groups else [{} for _ in range(world)]
    ranks = [
        {
            "rank": r,
            "node": r // req.nproc_per_node,
            "host": trainer_hosts[r // req.nproc_per_node],
            "local_rank": r % req.nproc_per_node,
            **per_rank[r],
        }
        for r in range(world)
    ]
    rendezvous = f"{req.master_addr or trainer_hosts[0]}:{req.master_port}"
    return Plan(
        req.mode,
        world,
        sizes,
        trainer_hosts,
        req.nproc_per_node,
        rendezvous,
        engine_hosts,
        engines,
        router,
        extra,
        ranks,
        cfg.run_dir,
        list(ck.preempt_signals),
        asdict(allocation) if allocation is not None else None,
        spec_args,
    )


def _server_speculation(rollout: Any) -> tuple[list[str], list[str]]:
    """The engine nodes' SGLang `--speculative-*` flags of `rollout.speculative_*` (config/speculative.py),
    and the trainer's overrides: its servers speculate, it builds no engine of its own that would."""
    if rollout.speculative_algorithm == "none":
        return [], []
    bad = list(speculative_shape_errors(rollout))
    if rollout.speculative_num_steps < 1:
        bad.append(("rollout.speculative_num_steps", f"must be >= 1, got {rollout.speculative_num_steps}"))
    if rollout.speculative_algorithm in NEEDS_DRAFT_MODEL and not rollout.speculative_draft_model_path:
        bad.append(("rollout.speculative_draft_model_path", f"{rollout.speculative_algorithm} needs a draft model"))
    if rollout.speculative_schedule != "fixed":
        bad.append(("rollout.speculative_schedule", "dspark is the embedded engine's; SGLang servers verify a fixed k"))
    if bad:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {key}: {message}" for key, message in bad))
    overrides = [
        "rollout.speculative_algorithm=none",
        "rollout.speculative_draft_model_path=null",
        "rollout.speculative_schedule=fixed",
    ]
    return sglang_speculative_flags(rollout), overrides


def format_plan(plan: Plan) -> str:
    s = plan.sizes
    lines = [
        f"plan: mcore-rl {plan.mode} on {len(plan.trainer_hosts) + len(plan.engine_hosts)} node(s); "
        "dry run, nothing started"
    ]
    if plan.allocation:
        a = plan.allocation
        lines.append(f"allocation: SLURM job {a['job_id']}, {a['nodes']} node(s) x {a['gpus_per_node']} GPU(s)")
    lines.append(
        f"trainer: {len(plan.trainer_hosts)} node(s) x {plan.nproc_per_node} rank(s) = world size "
        f"{plan.world_size} on {', '.join(plan.trainer_hosts)}"
    )
    lines.append(
        f"layout: TP={s['tp']} PP={s['pp']} VPP={s['vpp'] or '-'} CP={s['cp']} DP={s['dp']} | "
        f"EP={s['ep']} ETP={s['etp']} EDP={s['edp']}"
    )
    lines.append(f"rendezvous: c10d at {plan.rendezvous} (torchrun --rdzv-endpoint; the first trainer node)")
    if plan.engines:
        lines.append(f"engines: {len(plan.engines)} server(s) on {len(plan.engine_hosts)} node(s):")
        lines += [f"  {e['url']}  GPUs {e['gpus']} (TP {e['tp']})" for e in plan.engines]
    r = plan.router
    if r["kind"] == "embedded":
        lines.append(f"engines: embedded, on {r['where']} (rollout.engine_urls is empty)")
    elif r["kind"] != "none":
        lines.append(f"router: {r['kind']}" + (f" at {r['url']}" if r["url"] else "") + f" on {r['where']}")
    if plan.engine_spec_args:
        lines.append("engine speculative decoding (SGLang's flags): " + " ".join(plan.engine_spec_args))
    lines.append("trainer overrides: " + (" ".join(plan.trainer_overrides) or "(none)"))
    if plan.ranks and plan.ranks[0].get("tp") is not None:
        header = ["rank", "node", "host", "local"] + [g.upper() for g in GROUPS]
        rows = [
            [str(x["rank"]), str(x["node"]), x["host"], str(x["local_rank"])] + [_ranks(x[g]) for g in GROUPS]
            for x in plan.ranks
        ]
        widths = [max(len(c) for c in col) for col in zip(header, *rows)]
        lines.append("process groups (global ranks of each rank's group):")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    """[0,1,2,3] -> "0-3"; [0,2,4] -> "0,2,4" (a column stays readable at 8 x 8 ranks)."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def emit_shell(plan: Plan) -> str:
    """The plan as shell assignments for `eval` in launch/slurm.sbatch."""
    values = {
        "TRAINER_NODES": str(len(plan.trainer_hosts)),
        "TRAINER_NODELIST": ",".join(plan.trainer_hosts),
        "NPROC": str(plan.nproc_per_node),
        "MASTER_ADDR": plan.rendezvous.rsplit(":", 1)[0],
        "MASTER_PORT": plan.rendezvous.rsplit(":", 1)[1],
        "ENGINE_NODES": str(len(plan.engine_hosts)),
        "ENGINE_NODELIST": ",".join(plan.engine_hosts),
        "ENGINE_URLS": " ".join(e["url"] for e in plan.engines),
        "ENGINE_PORTS": " ".join(sorted({str(e["port"]) for e in plan.engines}, key=int)),
        "ENGINE_GPUS": " ".join(sorted({e["gpus"] for e in plan.engines}, key=lambda g: int(g.split(",")[0])))
        if plan.engines
        else "",
        "ROUTER": plan.router["kind"],
        "ROUTER_URL": plan.router["url"] or "",
        "ROUTER_PORT": plan.router["url"].rsplit(":", 1)[1] if plan.router["url"] else "",
    }
    values.update(RUN_DIR=plan.run_dir, PREEMPT_SIGNALS=" ".join(plan.preempt_signals))
    values["ENGINE_SPEC_ARGS"] = shlex.join(plan.engine_spec_args)
    lines = [f"{k}={shlex.quote(v)}" for k, v in values.items()]
    for name, items in (
        ("TRAINER_OVERRIDES", plan.trainer_overrides),
        ("TORCHRUN_SIGNAL_FLAGS", torchrun_signal_flags(plan.preempt_signals) if plan.preempt_signals else []),
    ):
        lines.append(f"{name}=(" + " ".join(shlex.quote(o) for o in items) + ")")
    return "\n".join(lines)


USAGE = (
    "mcore-rl launch --dry-run [--nnodes N] [--nproc-per-node G] [--engine-nodes E ...] {sft,train} "
    "[RECIPE.yaml] [key.path=value ...]"
)


def add_launch_parser(sub: argparse._SubParsersAction) -> None:
    """`mcore-rl launch`; the scripts in launch/ run `python -m mcore_rl.parallel.launch_plan` (the same
    parser), which skips importing every other command."""
    build_parser(
        sub.add_parser(
            "launch", usage=USAGE, help="the plan of a torchrun/SLURM launch: nodes, ranks, groups, engines (--dry-run)"
        )
    )


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("mode", choices=["sft", "train"])
    p.add_argument("recipe", nargs="?", help="YAML recipe; defaults if omitted")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for sft/train")
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing (the only mode)")
    p.add_argument(
        "--nnodes", type=int, default=None, help="trainer nodes (default: the allocation's minus the engine nodes)"
    )
    p.add_argument("--nproc-per-node", type=int, default=None, help="trainer ranks per node (default: GPUs per node)")
    p.add_argument("--engine-nodes", type=int, default=0, help="nodes for inference servers (train)")
    p.add_argument("--engines-per-node", type=int, default=1, help="servers per engine node")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs of an engine node (default: the allocation's)")
    p.add_argument("--engine-model", default=os.environ.get("ENGINE_MODEL"), help="HF checkpoint for the servers")
    p.add_argument("--hosts", default=None, help="comma-separated node names (default: the SLURM allocation's)")
    p.add_argument("--master-addr", default=None, help="rendezvous host (default: the first trainer node)")
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 29500)))
    p.add_argument("--engine-port", type=int, default=30000)
    p.add_argument("--router-port", type=int, default=30080)
    p.add_argument("--resume", action="store_true", help="resume from checkpoint.save_dir when it holds a checkpoint")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--emit", choices=["shell"], help="print shell assignments (launch/slurm.sbatch reads them)")
    p.set_defaults(func=cmd_launch, usage=p.format_usage)
    return p


def cmd_launch(args: argparse.Namespace) -> int:
    if not (args.dry_run or args.emit):
        print(
            "mcore-rl launch: only plans (--dry-run); start a run with launch/torchrun.sh or launch/slurm.sbatch "
            "(docs/launch.md)",
            file=sys.stderr,
        )
        return 2
    try:
        alloc = slurm_allocation()
        nproc = args.nproc_per_node or (alloc.gpus_per_node if alloc and alloc.gpus_per_node else None) or 1
        nnodes = args.nnodes or (max(1, alloc.nodes - args.engine_nodes) if alloc else 1)
        req = LaunchRequest(
            args.mode,
            nnodes,
            nproc,
            args.engine_nodes,
            args.engines_per_node,
            args.gpus_per_node,
            args.engine_model,
            args.hosts.split(",") if args.hosts else [],
            args.master_addr,
            args.master_port,
            args.engine_port,
            args.router_port,
            args.resume,
        )
        plan = make_plan(req, args.recipe, args.overrides, groups=args.emit is None, allocation=alloc)
    except (ConfigError, FileNotFoundError) as err:
        print(f"mcore-rl launch: {err}", file=sys.stderr)
        return 2
    if args.emit == "shell":
        print(emit_shell(plan))
    elif args.json:
        print(json.dumps(asdict(plan), indent=1))
    else:
        print(format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(cmd_launch(build_parser(argparse.ArgumentParser(prog="mcore-rl launch", usage=USAGE)).parse_args()))
