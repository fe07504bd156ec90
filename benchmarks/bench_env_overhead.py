"""Environment and tool overhead per turn: what one `step` of each shipped environment and one call of
each tool costs on this machine's CPU (to set against a turn's generation time).

    python benchmarks/bench_env_overhead.py                 # 5 rounds, the cases alternated every round
    python benchmarks/bench_env_overhead.py --rounds 9 --json out.json

Cases (each timed as wall time around the call, in this process):

* `guess_number.step`, `frozen_lake.step`, `taxi.step`: one move of the game (reset not counted);
* `calculator`, `search`: one tool call through `Toolset.run` (schema check, thread, answer);
* `python.first_call`: a new `PythonTool` and its first cell (`x = 1`) — the sandbox's start;
* `python.call`: a later cell (`x += 1; x`) in the running interpreter;
* `code_repair.step[tiny_code]`: one attempt checked by the sandboxed code checker;
* `guarded.step`: `guess_number.step` behind `GuardedEnv` (the guard's thread and checks);
* `process_env.start`: `make_process_env("guess_number")` and its close (a child interpreter);
* `process_env.step`: `guess_number.step` in that child (a pickled round trip).

* `generate.turn[tiny]`, `generate.turn[135m]`: one model turn on the embedded engine (`EngineCore`,
  fp32, batch 1, random weights): the prefill of a `--context`-token conversation and `--turn-tokens`
  decoded tokens, for the demo's 2-layer shape and a SmolLM2-135M-like one (30 layers, hidden 576,
  9 heads / 3 KV heads, FFN 1536, vocabulary 49,152).

The cases are run round-robin, one sample each per round, so background load hits them alike;
printed: median and min..max over rounds, in milliseconds, and each environment/tool case's median
as a share of each shape's median turn (batch 1: a rollout batches turns, so this is the share in
one episode's own latency, not in the engine's throughput).

    python benchmarks/bench_env_overhead.py --sessions 4    # memory of 4 live Python-tool interpreters

`--sessions N` instead starts N Python tools, runs a cell in each and prints their processes'
proportional set size (PSS, shared pages split between the processes that share them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mcore_rl.config.schema import ModelConfig
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn, ToolCall
from mcore_rl.envs import env_prompts, make_env
from mcore_rl.envs.base import AgentAction
from mcore_rl.envs.guard import GuardedEnv
from mcore_rl.envs.process import make_process_env
from mcore_rl.envs.tools import Toolset
from mcore_rl.envs.tools.calculator import Calculator
from mcore_rl.envs.tools.python_tool import PythonTool
from mcore_rl.envs.tools.search import Search

warnings.filterwarnings("ignore", category=DeprecationWarning)


def act(text: str, *calls: ToolCall) -> AgentAction:
    return AgentAction(text=text, parsed=ParsedTurn(content=text, calls=list(calls)))


def first_prompt(name: str, **options: object) -> Prompt:
    text, label = env_prompts(name, **options).examples(1, 0)[0]
    return Prompt(0, text, [], label)


def timed(setup: Callable[[], Callable[[], object]]) -> float:
    """Milliseconds of the call that `setup()` returns (setup itself not timed)."""
    call = setup()
    t0 = time.perf_counter()
    call()
    return 1000 * (time.perf_counter() - t0)


def game_step(name: str, move: str, guarded: bool = False) -> Callable[[], Callable[[], object]]:
    def setup() -> Callable[[], object]:
        env = make_env(name)
        target = GuardedEnv(env) if guarded else env
        target.reset(first_prompt(name), 0)

        def call() -> object:
            out = target.step(act(move))
            env.close()
            return out

        return call

    return setup


SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),  # the defaults: the demo's 2 layers, hidden 64, vocabulary 384
    "135m": ModelConfig(  # SmolLM2-135M's shape (its config.json), with this package's Qwen3-style blocks
        hidden_size=576,
        ffn_hidden_size=1536,
        num_layers=30,
        num_attention_heads=9,
        num_query_groups=3,
        vocab_size=49152,
    ),
}


class _AnyIds:
    """The byte tokenizer for a model whose vocabulary is wider than its 384 ids (the 135M shape's
    49,152): the engine decodes each turn's text, and random weights sample any id; the text is not
    used here, so ids past the bytes decode as one byte each."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return str(self.tokenizer.decode([i % 256 for i in ids], **kwargs))


def generate_turn(shape: str, context: int, turn_tokens: int) -> Callable[[], Callable[[], object]]:
    """One turn on the embedded engine: prefill `context` tokens, decode `turn_tokens` (eos ignored)."""
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams  # lazy: the generation cases alone need these

    torch.manual_seed(0)
    shaped = dataclasses.replace(SHAPES[shape], max_position_embeddings=context + turn_tokens + 8)
    config = hf_config_from_model_config(shaped)
    model = McoreRLForCausalLM(config).eval()
    tokenizer = _AnyIds(load_tokenizer(None))
    ids = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(1)).tolist()

    def setup() -> Callable[[], object]:
        engine = EngineCore(model, tokenizer, max_running_requests=1, context_length=context + turn_tokens + 1)

        def call() -> object:
            engine.add_request(Request("0", ids, SamplingParams(max_new_tokens=turn_tokens, ignore_eos=True)))
            while engine.has_work():
                engine.step()
            return None

        return call

    return setup


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = {int(k) for k in f.read().split()}
            except OSError:
                continue
            todo += sorted(kids - out)
            out |= kids
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def sessions_memory(n: int) -> None:
    tools = [PythonTool() for _ in range(n)]
    try:
        for tool in tools:
            tool.run({"code": "x = 1"}, 30.0)
        procs = _descendants(os.getpid())
        total = sum(_pss_kb(p) for p in procs) / 1024
        print(f"{n} interpreters: {len(procs)} processes, PSS {total:.1f} MiB ({total / n:.1f} MiB each)")
    finally:
        for tool in tools:
            tool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--sessions", type=int, default=0)
    ap.add_argument("--context", type=int, default=256, help="generation cases: tokens of the conversation so far")
    ap.add_argument("--turn-tokens", type=int, default=32, help="generation cases: tokens of the model's turn")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES), help="generation cases")
    args = ap.parse_args()
    if args.sessions:
        sessions_memory(args.sessions)
        return

    calculator, search = Toolset([Calculator()]), Toolset([Search()])
    python = PythonTool()
    python.run({"code": "x = 0"}, 10.0)
    repair_prompt = Prompt(0, "f(x)=3x+1", [], None)

    def repair() -> Callable[[], object]:
        env = make_env("code_repair", task="tiny_code")
        env.reset(repair_prompt, 0)
        return lambda: env.step(act("lambda x:3*x"))

    def fresh_python() -> Callable[[], object]:
        def call() -> object:
            tool = PythonTool()
            try:
                return tool.run({"code": "x = 1"}, 10.0)
            finally:
                tool.close()

        return call

    def process_start() -> Callable[[], object]:
        return lambda: make_process_env("guess_number").close()

    def process_step() -> Callable[[], object]:
        env = make_process_env("guess_number")
        env.reset(first_prompt("guess_number"), 0)

        def call() -> object:
            out = env.step(act("8"))
            env.close()
            return out

        return call

    cases: dict[str, Callable[[], Callable[[], object]]] = {
        "process_env.start": process_start,
        "process_env.step": process_step,
        "guess_number.step": game_step("guess_number", "8"),
        "guarded.step": game_step("guess_number", "8", guarded=True),
        "frozen_lake.step": game_step("frozen_lake", "right"),
        "taxi.step": game_step("taxi", "north"),
        "calculator": lambda: (
            lambda: calculator.run(ParsedTurn("", [ToolCall("calculator", {"expression": "17*23-sqrt(16)"})]))
        ),
        "search": lambda: lambda: search.run(ParsedTurn("", [ToolCall("search", {"query": "capital of Canada"})])),
        "python.call": lambda: lambda: python.run({"code": "x += 1\nx"}, 10.0),
        "python.first_call": fresh_python,
        "code_repair.step[tiny_code]": repair,
    }
    turns = {f"generate.turn[{shape}]": generate_turn(shape, args.context, args.turn_tokens) for shape in args.shapes}
    cases.update(turns)
    for setup in cases.values():  # warm-up: imports, corpus index, gymnasium
        timed(setup)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds):
        names = list(cases)
        names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order every round
        for name in names:
            samples[name].append(timed(cases[name]))
    python.close()
    print(f"{'case':32s} {'median ms':>10s} {'min..max ms':>20s}")
    for name, xs in samples.items():
        print(f"{name:32s} {statistics.median(xs):10.2f} {min(xs):9.2f}..{max(xs):.2f}")
    if turns:
        print(f"\nshare of one turn (batch 1, {args.context}-token context, {args.turn_tokens} new tokens), medians:")
        print(f"{'case':32s} " + " ".join(f"{name[len('generate.') :]:>18s}" for name in turns))
        turn_ms = [statistics.median(samples[name]) for name in turns]
        for name, xs in samples.items():
            if name not in turns:
                print(f"{name:32s} " + " ".join(f"{statistics.median(xs) / t:18.2%}" for t in turn_ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rounds": args.rounds, "context": args.context, "turn_tokens": args.turn_tokens, "ms": samples},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
