"""Memory and throughput of `mcore-rl serve` on a long-context mix (the KV pool's bench).

Starts `mcore-rl serve` of a tiny random model (dummy weights) with a long context, sends a mix
of short prompts and 2k-5k-token prompts from concurrent clients, and reports the server's peak
resident memory (VmHWM of its process), its resident memory before the mix, the output
throughput and whether every request was answered. Run it with PYTHONPATH pointing at two
checkouts to compare them; flags after `--` go to `mcore-rl serve` (e.g. `--max-total-tokens`).

    python benchmarks/bench_kv_pool.py                                   # default pool (mem-fraction)
    python benchmarks/bench_kv_pool.py -- --max-total-tokens 12288       # a tight pool: long prompts wait
    python benchmarks/bench_kv_pool.py --rounds 3 --json out.json

The model: hidden 256, 4 layers, 2 query / 2 KV heads of 128 (8 KiB of fp32 K/V per token),
max_position_embeddings 8192, `--max-running-requests 16`. Few heads keep the prefill's attention
scores (heads x S^2 floats per prompt) small, so the KV cache is what grows with the mix.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

MODEL = dict(
    hidden_size=256,
    num_layers=4,
    ffn_hidden_size=512,
    num_attention_heads=2,
    num_query_groups=2,
    kv_channels=128,
    max_position_embeddings=8192,
    vocab_size=384,
)


def write_model(path: str) -> None:
    from mcore_rl.config.schema import ModelConfig
    from mcore_rl.rollout.engine_processes import write_model_dir

    write_model_dir(ModelConfig.of(**MODEL), path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def rss_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def mix(seed: int, shorts: int, longs: list[int], new_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    bodies = [{"input_ids": [rng.randrange(384) for _ in range(rng.randrange(16, 128))]} for _ in range(shorts)]
    bodies += [{"input_ids": [rng.randrange(384) for _ in range(n)]} for n in longs]
    rng.shuffle(bodies)
    for b in bodies:
        b["sampling_params"] = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    return bodies


def one_round(serve_flags: list[str], args: argparse.Namespace, model_dir: str) -> dict:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "serve",
        "--model-path",
        model_dir,
        "--load-format",
        "dummy",
        "--port",
        str(port),
        "--context-length",
        "8192",
        "--max-running-requests",
        "16",
        "--device",
        "cpu",
        *serve_flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}") from None
                time.sleep(0.1)
        post(url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})  # warm
        idle = rss_kib(proc.pid, "VmRSS")
        info = json.loads(urllib.request.urlopen(url + "/get_server_info").read())
        bodies = mix(args.seed, args.shorts, args.longs, args.new_tokens)
        t0 = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda b: post(url + "/generate", b), bodies))
        wall = time.monotonic() - t0
        ok = [r for s, r in results if s == 200]
        alive = proc.poll() is None
        peak = rss_kib(proc.pid, "VmHWM") if alive else None
        tokens = sum(r["meta_info"]["completion_tokens"] for r in ok)
        return {
            "answered": len(ok),
            "sent": len(bodies),
            "alive": alive,
            "idle_rss_mib": idle / 1024,
            "peak_rss_mib": None if peak is None else peak / 1024,
            "wall_s": wall,
            "tok_per_s": tokens / wall,
            "max_total_num_tokens": info.get("max_total_num_tokens"),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shorts", type=int, default=24)
    p.add_argument("--longs", type=int, nargs="*", default=[2000, 3000, 4000, 5000])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every round's figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as model_dir:
        write_model(model_dir)
        rounds = [one_round(serve_flags, args, model_dir) for _ in range(args.rounds)]
    for r in rounds:
        print(json.dumps(r))
    if len(rounds) > 1:
        for key in ("peak_rss_mib", "tok_per_s"):
            vals = [r[key] for r in rounds if r[key] is not None]
            if vals:
                print(f"{key}: median {statistics.median(vals):.1f} [{min(vals):.1f}-{max(vals):.1f}]")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"serve_flags": serve_flags, "args": vars(args), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
