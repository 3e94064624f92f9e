"""Collective benchmark: every collective x algorithm x size, predicted against measured (see
soybean/bench/collectives.py).

    python scripts/bench_collectives.py --devices 4 [--profile NAME_OR_JSON|calibrate] [--sizes 4K,1M,64M] [--json]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soybean.bench.collectives import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
