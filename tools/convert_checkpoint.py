#!/usr/bin/env python3
"""Hugging Face <-> megatron-core checkpoint conversion; the same as `mcore-rl convert`.

    python tools/convert_checkpoint.py hf-to-mcore --input HF_DIR --output MCORE_DIR [--tp N --pp N --ep N]
    python tools/convert_checkpoint.py mcore-to-hf --input MCORE_CKPT --output HF_DIR

See `mcore_rl/convert/` for what each direction writes and `docs/serving.md` for serving the result.
"""

import sys

from mcore_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
