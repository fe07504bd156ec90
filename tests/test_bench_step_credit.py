"""benchmarks/bench_step_credit.py's resume: a finished run is summarized from its metrics, an unfinished one is not.

The grid is split over processes and a driver may stop while its training run goes on; `adopt` decides
from the run's own metrics whether it is done, so a resumed driver neither reruns nor miscounts it.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys


def _bench():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_step_credit.py"
    if "bench_step_credit" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_step_credit", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_step_credit"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_step_credit"]


def _write_run(work: pathlib.Path, name: str, records: list[dict]) -> None:
    (work / name).mkdir()
    with open(work / name / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _records(steps: int, with_eval: bool) -> list[dict]:
    recs = []
    for s in range(1, steps + 1):
        recs.append({"rl_step": s, "train/tokens": 100.0, "episode/return_mean": s / 10, "advantage/abs_mean": 0.5})
        recs.append({"rl_step": s, "train/tokens": 50.0})
    if with_eval:
        recs[-1].update({"eval/avg@4": 0.25, "eval/greedy_pass@1": 0.5})
    return recs


def test_a_run_with_its_final_evaluation_is_adopted_and_one_without_is_not(tmp_path):
    bench = _bench()
    _write_run(tmp_path, "grpo_s1", _records(6, with_eval=True))
    _write_run(tmp_path, "gigpo_s1", _records(6, with_eval=False))  # still training
    _write_run(tmp_path, "hgpo_s1", _records(4, with_eval=True))  # evaluated, but not at the final step
    (tmp_path / "grpo_s1.start").write_text("100.0\n")
    (tmp_path / "grpo_s1.log").write_text("done\n")

    assert bench.adopt(str(tmp_path), "grpo", 1, 6, 4)
    assert not bench.adopt(str(tmp_path), "gigpo", 1, 6, 4)
    assert not bench.adopt(str(tmp_path), "hgpo", 1, 6, 4)
    assert not (tmp_path / "gigpo_s1.json").exists() and not (tmp_path / "hgpo_s1.json").exists()

    got = json.loads((tmp_path / "grpo_s1.json").read_text())
    assert (got["avgk"], got["greedy"], got["step"]) == (0.25, 0.5, 6)
    assert got["train_tokens"] == 6 * 150.0  # every optimizer step's tokens
    assert abs(got["return_first5"] - 0.3) < 1e-9 and abs(got["return_last5"] - 0.4) < 1e-9
    assert got["wall_s"] > 0  # the start stamp to the log's last write

    # a json, once written, is what counts: the run is not summarized again
    (tmp_path / "grpo_s1" / "metrics.jsonl").unlink()
    assert bench.adopt(str(tmp_path), "grpo", 1, 6, 4)


def test_the_warm_arm_is_done_at_step_zero(tmp_path):
    bench = _bench()
    _write_run(tmp_path, "warm_s2", [{"rl_step": 0, "eval/avg@4": 0.5, "eval/greedy_pass@1": 0.75}])
    assert not bench.adopt(str(tmp_path), "grpo", 2, 6, 4)  # no such run
    assert bench.adopt(str(tmp_path), "warm", 2, 6, 4)
    assert json.loads((tmp_path / "warm_s2.json").read_text())["avgk"] == 0.5
    assert bench.clean({"a": [float("nan"), 1.0]}) == {"a": [None, 1.0]}
