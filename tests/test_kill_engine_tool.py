"""tools/kill_engine_mid_run.py against a real process tree: it kills one engine below the trainer,
after the drawn number of step records, and nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in trainer: two children whose command lines are a started engine's
# (`python -m mcore_rl.cli serve ...` as argv, though they only sleep), one unrelated child, and a
# metrics.jsonl that gains an evaluation record and then one step record every 0.3 s.
TRAINER = textwrap.dedent(
    """
    import json, subprocess, sys, time
    run_dir = sys.argv[1]
    sleeper = "import time; time.sleep(120)"
    kids = [subprocess.Popen([sys.executable, "-c", sleeper, "-m", "mcore_rl.cli", "serve"]) for _ in range(2)]
    other = subprocess.Popen([sys.executable, "-c", sleeper, "unrelated"])
    print(json.dumps({"engines": [k.pid for k in kids], "other": other.pid}), flush=True)
    with open(run_dir + "/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 0, "eval/greedy_pass@1": 0.2}) + "\\n")
        for step in range(1, 40):
            time.sleep(0.3)
            f.write(json.dumps({"step": step, "reward/mean": 0.5}) + "\\n")
            f.flush()
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_one_engine_below_the_trainer_is_killed_after_the_drawn_step(tmp_path: str) -> None:
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None
        pids = json.loads(trainer.stdout.readline())
        tool = subprocess.run(
            [
                sys.executable,
                os.path.join(REPO, "tools", "kill_engine_mid_run.py"),
                "--trainer-pid",
                str(trainer.pid),
                "--run-dir",
                str(tmp_path),
                "--after-steps",
                "3",
                "5",
                "--poll-s",
                "0.1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert tool.returncode == 0, tool.stderr
        report = json.loads(tool.stdout.strip().splitlines()[-1])
        assert sorted(report["engines"]) == sorted(pids["engines"])
        assert report["killed"] in pids["engines"]
        assert 3 <= report["target_records"] <= 5 and report["after_records"] >= report["target_records"]
        time.sleep(0.5)
        survivor = next(p for p in pids["engines"] if p != report["killed"])
        assert not _alive(report["killed"])
        assert _alive(survivor) and _alive(pids["other"])
    finally:
        for pid in (*pids["engines"], pids["other"]) if "pids" in locals() else ():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        trainer.kill()
        trainer.wait()
