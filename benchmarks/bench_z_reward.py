"""Z-Reward on CPU: a tiny generative teacher, its score distributions, and the student distilled
from them (docs/reward_models.md, "Z-Reward's teacher and student, measured").

1. Pairs from the shipped addition task (`tools/make_preference_pairs.py`'s `task_pairs`): training
   pairs and held-out pairs of other problems.
2. The teacher: `--teacher sft` trains a causal LM of the demo's size (`mcore-rl sft`) to answer the
   judging prompt (`--template`, the cue "Score (0-9): ") with "9" after a correct sum and "0" after
   a wrong one, and exports it to HF; `--teacher random` takes a random model of that size as it is.
3. The labeller (`tools/label_score_distributions.py`, the teacher served by `mcore-rl serve`) writes
   the teacher's q over "0".."9" for every response of both sets.
4. The student: `mcore-rl rm-train` with `reward_model.objective=score_distribution`
   (`num_heads=10`) on the training rows.
5. On the held-out rows: the mean KL(q_T ‖ q_S), the KL of a constant student (the teacher's mean
   training distribution) for scale, the Spearman correlation of the expected scores μ_T and μ_S,
   and each one's pair accuracy (μ of the correct answer > μ of the wrong one).

    python benchmarks/bench_z_reward.py --work runs/bench_z_reward --teacher sft --sft-steps 400 --rm-steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = "{prompt}{response}\n"  # compact: the tiny teacher's context is short
CUE = "Score (0-9): "


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONWARNINGS="ignore", MCORE_RL_PROGRESS="0")
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{done.stderr[-3000:]}")
    print(f"  {' '.join(cmd[1:4])} ... {time.monotonic() - t0:.0f}s", flush=True)


def _pairs(n: int, seed: int) -> list[dict]:
    from mcore_rl.data.preferences import pair_to_json, task_pairs

    return [pair_to_json(p) for p in task_pairs("addition", n, seed, 2, "none")]


def _write(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def _teacher(work: str, kind: str, train: list[dict], steps: int, seed: int) -> str:
    hf = f"{work}/teacher_hf"
    if os.path.isdir(hf):
        return hf
    if kind == "random":  # a random causal LM of 2 layers, hidden 32, with the byte tokenizer's vocabulary
        from mcore_rl.config.schema import ModelConfig
        from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

        torch.manual_seed(0)
        mc = ModelConfig(
            vocab_size=384,
            hidden_size=32,
            ffn_hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            num_query_groups=2,
            max_position_embeddings=256,
        )
        McoreRLForCausalLM(hf_config_from_model_config(mc)).float().save_pretrained(hf, safe_serialization=True)
        return hf
    rows = []
    for p in train:
        for side, score in (("chosen", "9"), ("rejected", "0")):
            rows.append({"prompt": TEMPLATE.format(prompt=p["prompt"], response=p[side]) + CUE, "response": score})
    data = _write(f"{work}/teacher_sft.jsonl", rows)
    ckpt = f"{work}/teacher_ckpt"
    _run(
        [sys.executable, "-m", "mcore_rl.cli", "sft", f"{ROOT}/configs/sft_demo.yaml", f"run_dir={work}/teacher_run"]
        + [f"data.path={data}", f"train.train_iters={steps}", f"train.seed={seed}", "train.seq_length=64"]
        + ["train.micro_batch_size=16", "train.global_batch_size=16", "train.eval_interval=0", "train.log_interval=50"]
        + [f"checkpoint.save_dir={ckpt}"]
    )
    _run([sys.executable, "-m", "mcore_rl.cli", "convert", "mcore-to-hf", "--input", ckpt, "--output", hf])
    return hf


def _label(work: str, hf: str, pairs: str, out: str) -> list[dict]:
    if not os.path.exists(out):
        template = _write_text(f"{work}/template.txt", TEMPLATE)
        _run(
            [sys.executable, f"{ROOT}/tools/label_score_distributions.py", "--model-path", hf, "--data", pairs]
            + ["--out", out, "--template-file", template, "--cue", CUE, "--batch", "64"]
        )
    return [json.loads(line) for line in open(out, encoding="utf-8")]


def _write_text(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _ranks(x: torch.Tensor) -> torch.Tensor:
    order = x.argsort()
    r = torch.empty_like(x)
    r[order] = torch.arange(len(x), dtype=x.dtype)
    return r


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-30))


def _student_q(work: str, rows: list[dict], steps: int) -> torch.Tensor:
    """The trained student's q over the held-out rows (every head's logit at the last token)."""
    from mcore_rl.config import load_config
    from mcore_rl.config.rm_schema import RMConfig
    from mcore_rl.data.preferences import LabelledResponse, labelled_rows
    from mcore_rl.train import reward_model as rm

    cfg = load_config(
        RMConfig,
        f"{ROOT}/configs/rm_demo.yaml",
        [
            f"run_dir={work}/student_eval",
            f"data.path={work}/train_labels.jsonl",
            f"checkpoint.load_dir={work}/student_ckpt",
        ]
        + ["reward_model.objective=score_distribution", "reward_model.num_heads=10", "train.seq_length=40"]
        + [f"train.train_iters={steps}", "train.eval_iters=1"],
    )
    trainer = rm.build_trainer(cfg)
    examples = [LabelledResponse(r["prompt"], r["response"], 0.0, 0, distribution=r["label"]) for r in rows]
    base = labelled_rows(examples, 40, trainer.tokenizer)
    logits = []
    for head in range(10):
        batch = {"tokens": base["tokens"], "index": base["index"], "head": torch.full_like(base["head"], head)}
        logits.append(rm.score_rows(trainer.chunks, batch, 64))
    return torch.softmax(torch.stack(logits, -1).double(), -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/bench_z_reward")
    ap.add_argument("--teacher", choices=("sft", "random"), default="sft")
    ap.add_argument("--train-pairs", type=int, default=1000)
    ap.add_argument("--heldout-pairs", type=int, default=200)
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--rm-steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    t0 = time.monotonic()
    train = _pairs(args.train_pairs, args.seed)
    held = _pairs(args.heldout_pairs, args.seed + 1_000_003)
    train_path = _write(f"{work}/train_pairs.jsonl", train)
    held_path = _write(f"{work}/heldout_pairs.jsonl", held)
    hf = _teacher(work, args.teacher, train, args.sft_steps, args.seed)
    train_rows = _label(work, hf, train_path, f"{work}/train_labels.jsonl")
    held_rows = _label(work, hf, held_path, f"{work}/heldout_labels.jsonl")
    if not os.path.isdir(f"{work}/student_ckpt"):
        _run(
            [
                sys.executable,
                "-m",
                "mcore_rl.cli",
                "rm-train",
                f"{ROOT}/configs/rm_demo.yaml",
                f"run_dir={work}/student",
            ]
            + [f"data.path={work}/train_labels.jsonl", "reward_model.objective=score_distribution"]
            + ["reward_model.num_heads=10", "train.seq_length=40", f"train.train_iters={args.rm_steps}"]
            + ["train.micro_batch_size=16", "train.global_batch_size=16", "train.eval_iters=1"]
            + [f"train.eval_interval={args.rm_steps}", "train.log_interval=50", f"train.seed={args.seed}"]
            + [f"checkpoint.save_dir={work}/student_ckpt"]
        )
    q_t = torch.tensor([r["label"] for r in held_rows], dtype=torch.float64)
    q_s = _student_q(work, held_rows, args.rm_steps)
    values = torch.arange(10, dtype=torch.float64)
    mu_t, mu_s = q_t @ values, q_s @ values
    kl = (q_t * (q_t.clamp_min(1e-30).log() - q_s.clamp_min(1e-30).log())).sum(-1)
    mean_q = torch.tensor([r["label"] for r in train_rows], dtype=torch.float64).mean(0)
    kl_const = (q_t * (q_t.clamp_min(1e-30).log() - mean_q.log())).sum(-1)
    acc_t = float((mu_t[0::2] > mu_t[1::2]).double().mean())  # rows: chosen, rejected of each pair
    acc_s = float((mu_s[0::2] > mu_s[1::2]).double().mean())
    result = {
        "teacher": args.teacher,
        "heldout_rows": len(held_rows),
        "kl_teacher_student": float(kl.mean()),
        "kl_teacher_constant": float(kl_const.mean()),
        "spearman_mu": spearman(mu_t, mu_s),
        "teacher_pair_accuracy": acc_t,
        "student_pair_accuracy": acc_s,
        "teacher_mu_mean_std": [float(mu_t.mean()), float(mu_t.std())],
        "student_mu_mean_std": [float(mu_s.mean()), float(mu_s.std())],
        "teacher_top_prob_mean": float(q_t.max(-1).values.mean()),
        "seconds": round(time.monotonic() - t0),
    }
    print(json.dumps(result, indent=1))
    _write_text(f"{work}/result.json", json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
