"""How promptly a vLLM server answers while it generates (docs/serving.md#vllm-engines).

    MCORE_RL_VLLM_VENV=... python benchmarks/bench_vllm_responsiveness.py [--tokens 1200] [--repeats 3] \
        [--variant vllm-layout --variant split ...] [--autogroup-nice -20] [--setting name:KEY=VAL,KEY=VAL ...]

For each setting (environment variables of the server; `default` is what `VLLMEngineProcesses`
sets), one server of the demo's model (head dim 32) is started; then, for each variant (a change
to the running server: its processes' CPU affinity or nice), `--repeats` times, one long greedy
request (`--tokens` tokens, eos ignored) runs while `/metrics` is polled back to back. Printed per
generation: its wall, the probes answered while it ran, their median and largest latency, the
longest stretch with no answer, and per process of the server (the API server, EngineCore, the
worker) its affinity, nice, and the seconds its threads ran and waited runnable meanwhile
(`schedstat`). A server that answers nothing while it generates shows one probe as long as the
generation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

from mcore_rl.config.schema import ModelConfig
from mcore_rl.rollout.vllm_processes import SERVED_MODEL_NAME, VLLMEngineProcesses, split_two_cores

MODEL = ModelConfig(  # tests/test_vllm_engine.py's: the demo's model, head dim 32, 1280 positions
    vocab_size=384,
    hidden_size=64,
    ffn_hidden_size=256,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=32,
    max_position_embeddings=1280,
)


def tree(root: int) -> dict[int, str]:
    """The server's processes: pid -> name (vLLM titles them `VLLM::EngineCore`, `VLLM::Worker`...)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name, rest = raw.split("(", 1)[1].rsplit(")", 1)
        if int(rest.split()[2]) == root:  # the server leads its own process group
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                cmd = ""
            found[int(pid)] = cmd if "VLLM" in cmd else name
    return found


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) summed over `pid`'s threads."""
    run = wait = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                a, b, _ = f.read().split()
        except OSError:
            continue
        run, wait = run + int(a) / 1e9, wait + int(b) / 1e9
    return run, wait


def each_thread(pid: int, fn: object) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fn(int(tid))  # type: ignore[operator]
        except OSError:
            pass


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def measure(url: str, root: int, tokens: int) -> dict:
    procs = tree(root)
    before = {p: schedstat(p) for p in procs}
    done = threading.Event()
    body = {"model": SERVED_MODEL_NAME, "prompt": [257, *b"12+34="], "max_tokens": tokens, "temperature": 0.0}
    body["ignore_eos"] = True
    t0 = time.perf_counter()

    def gen() -> None:
        post(url + "/v1/completions", body)
        done.set()

    th = threading.Thread(target=gen)
    th.start()
    probes: list[tuple[float, float]] = []  # (start, latency)
    while not done.is_set():
        s = time.perf_counter()
        with urllib.request.urlopen(url + "/metrics", timeout=600) as r:
            r.read()
        probes.append((s - t0, time.perf_counter() - s))
    th.join()
    wall = time.perf_counter() - t0
    during = [lat for s, lat in probes if s + lat < wall]
    ends = [0.0] + [s + lat for s, lat in probes if s + lat < wall] + [wall]
    cpu = {}
    for p, name in procs.items():
        try:
            run, wait = schedstat(p)
            key = f"{name}[{p}] cpus={sorted(os.sched_getaffinity(p))} nice={os.getpriority(os.PRIO_PROCESS, p)}"
            cpu[key] = f"ran {run - before[p][0]:.2f} waited {wait - before[p][1]:.2f}"
        except OSError:
            pass
    return {
        "wall_s": round(wall, 3),
        "probes_answered_during": len(during),
        "probe_median_s": round(statistics.median(during), 4) if during else None,
        "probe_max_s": round(max(lat for _, lat in probes), 3),
        "longest_silence_s": round(max(b - a for a, b in zip(ends, ends[1:])), 3),
        "sched_s": cpu,
    }


def apply(variant: str, root: int) -> None:
    """Change the started server in place (what a variant names)."""
    core = [p for p, name in tree(root).items() if "EngineCore" in name]
    key, _, value = variant.partition("=")
    if key == "split":
        assert split_two_cores(root), "not two cores"
    elif key == "vllm-layout":  # vLLM's own: the worker on the first core, everything else on all
        cores = sorted(os.sched_getaffinity(0))
        for pid, name in tree(root).items():
            each_thread(pid, lambda tid: os.sched_setaffinity(tid, cores[:1] if "Worker" in name else cores))
    for pid in core:
        if key == "core-nice":
            each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, int(value)))
        elif key == "core-cpus":
            each_thread(pid, lambda tid: os.sched_setaffinity(tid, [int(c) for c in value.split(",")]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--variant",
        action="append",
        default=None,
        help="as-started | split (split_two_cores: what VLLMEngineProcesses does once a server answers) | "
        "vllm-layout (vLLM's own affinities: the worker on the first core, the rest anywhere) | "
        "core-nice=N (EngineCore's threads at nice N) | core-cpus=0,1 (EngineCore's affinity)",
    )
    ap.add_argument(
        "--autogroup-nice",
        type=int,
        default=None,
        help="the server's and this process's scheduler autogroup nice (root, for -N): an idle machine's share on a busy one",
    )
    ap.add_argument("--setting", action="append", default=[], help="name:KEY=VAL,KEY=VAL (server environment)")
    args = ap.parse_args()
    settings = args.setting or ["default:"]
    args.variant = args.variant or ["as-started"]
    print(f"load average {os.getloadavg()}", flush=True)
    for setting in settings:
        name, _, assigns = setting.partition(":")
        extra = dict(a.split("=", 1) for a in assigns.split(",") if a)
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                with VLLMEngineProcesses.start_vllm(
                    MODEL, num=1, workdir=tmp, context_length=1280, max_running_requests=8, startup_timeout_s=900
                ) as procs:
                    print(f"== {name} {extra} (start {time.perf_counter() - t:.0f} s)", flush=True)
                    url, root = procs.urls[0], procs.pids[0]
                    assert root is not None
                    if args.autogroup_nice is not None:  # the server leads its own session: its own autogroup
                        for pid in (root, os.getpid()):
                            with open(f"/proc/{pid}/autogroup", "w") as f:
                                f.write(str(args.autogroup_nice))
                    measure(url, root, 16)  # warm-up
                    for variant in args.variant:
                        apply(variant, root)
                        for _ in range(args.repeats):
                            row = measure(url, root, args.tokens)
                            print(variant, json.dumps(row), f"load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    sys.stdout.flush()


if __name__ == "__main__":
    main()
