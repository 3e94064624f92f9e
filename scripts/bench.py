"""Training-step benchmark: serial vs DDP, tensor parallel, FSDP2 and soybean's plans (see soybean/bench.py).

    python scripts/bench.py examples.models:mlp --devices 2 --arg hidden=4096 --arg batch=32 --arg layers=2
    python scripts/bench.py MODEL --devices N [--arg key=value ...] [--steps 10] [--warmup 3] [--json] [--profile NAME_OR_JSON]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soybean.bench.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
