"""The profiler's terminal tables and its JSON (one schema, `SCHEMA_VERSION`, for scripts)."""

from __future__ import annotations

from typing import Any

SCHEMA_VERSION = 1


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}" if b >= 2**28 else f"{b / 2**20:.2f}M"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(str(c).rjust(w) if k else str(c).ljust(w) for k, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_layouts(result: dict[str, Any]) -> str:
    c, sh = result["cluster"], result["shape"]
    head = (
        f"{result['model_name']} on {c['nodes']}x{c['gpus_per_node']} {c['name']} "
        f"({c['gpu_memory_gb']:.0f} GiB); global batch {sh['global_batch_size']} x {sh['seq_length']} tokens, "
        f"micro-batch {sh['micro_batch_size']}, {sh['precision']}, {sh['optimizer']}, recompute {sh['recompute']}, "
        f"distributed optimizer {'on' if sh['distributed_optimizer'] else 'off'}; "
        f"{result['num_valid_layouts']} valid layouts of {result['num_candidates']} candidates "
        f"(memory in GiB, M = MiB; time in s; efficiency {c['compute_efficiency']})"
    )
    rows = []
    for r in result["layouts"]:
        mem, t = r["memory"], r["time"]
        rows.append(
            [
                r["layout"],
                _gib(mem["params"]),
                _gib(mem["grads"]),
                _gib(mem["optimizer"]),
                _gib(mem["optimizer_distributed"]),
                _gib(mem["activations"]),
                _gib(mem["total"]),
                "yes" if r["fits"] else "NO",
                f"{t['compute_s']:.3g}",
                f"{t['tp_s'] + t['cp_s'] + t['ep_s']:.2g}",
                f"{t['pp_p2p_s']:.2g}",
                f"{t['dp_s']:.2g}",
                f"{t['bubble_fraction']:.2f}",
                f"{t['total_s']:.3g}",
                f"{r['mfu']:.2f}",
            ]
        )
    header = [
        "layout",
        "params",
        "grads",
        "optim",
        "optim(dist)",
        "activ",
        "total",
        "fits",
        "compute",
        "tp/cp/ep",
        "pp p2p",
        "dp",
        "bubble",
        "step",
        "MFU",
    ]
    return head + "\n" + _table(header, rows)


def format_measured(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        for st in r["stages"]:
            out.append(
                [
                    r["layout"],
                    str(st["pp_rank"]),
                    f"{st['measured']['params']}/{st['estimated']['params']}",
                    f"{st['measured']['grads']}/{st['estimated']['grads']}",
                    f"{st['measured']['optimizer']}/{st['estimated']['optimizer']}",
                    "exact" if st["model_state_exact"] else "DIFFERS",
                    f"{st['measured']['activation_peak']}/{st['estimated']['activations']:.0f}",
                    f"{st['activation_ratio']:.2f}",
                ]
            )
        out.append(
            [
                r["layout"],
                "all",
                "",
                "",
                "",
                "",
                "step s est/meas",
                f"{r['step_s_estimated']:.3g}/{r['step_s_measured']:.3g} = {r['step_time_ratio']:.2f}",
            ]
        )
    header = [
        "layout",
        "stage",
        "params B meas/est",
        "grads B",
        "optimizer B",
        "model state",
        "activ B meas/est",
        "est/meas",
    ]
    return "measured on this machine vs estimated\n" + _table(header, out)


def format_split(rows: list[dict[str, Any]], top: int) -> str:
    table = [
        [
            str(s["train_gpus"]),
            str(s["inference_gpus"]),
            str(s["inference_tp"]),
            s["train_layout"],
            f"{s['rollout_s']:.3g}",
            f"{s['train_s']:.3g}",
            f"{s['step_s']:.3g}",
        ]
        for s in rows[:top]
    ]
    return "RL split (fastest first)\n" + _table(
        ["train GPUs", "inference GPUs", "engine TP", "train layout", "rollout s", "train s", "step s"], table
    )
