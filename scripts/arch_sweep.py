"""The architecture sweep: Hugging Face architectures as loaded, trained with soybean and alone.

    python scripts/arch_sweep.py [--only gpt2,t5] [--family decoder] [--devices 2] [--tier threads|gloo]
                                 [--columns check,time,comm] [--json out.json]

For each architecture of ``soybean.models.archs`` (tiny sizes, the config's defaults otherwise), and a Llama-3
written as torchtitan writes it (``examples.models:llama3``; torchtitan's own where it imports): ``check``
runs every strategy of every rule its graph uses on simulated ranks in float64 (``soybean check``); ``time``
and ``comm`` train it 3 AdamW steps with ``soybean.parallelize(model, kwargs, devices=N, objective=...)``,
every rank a thread (``--tier threads``) or a gloo process (``--tier gloo``), and compare the loss, every
gradient and every parameter with the model trained alone.  Prints a Markdown table (architecture, family,
equal to serial per column with the parameters the plan split, ops without a rule) and a summary.

Your own model: ``soybean check pkg.module:fn --devices N`` runs the check column on it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soybean import sweep
from soybean.models import archs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated architecture names (default: all)")
    ap.add_argument("--family", default="", help=f"one family: {', '.join(archs.FAMILIES)}")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--tier", choices=("threads", "gloo"), default="threads")
    ap.add_argument("--columns", default="check,time,comm")
    ap.add_argument("--json", default="", help="also write the rows as JSON to this file")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of errors")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    chosen = [archs.BY_NAME[n] for n in a.only.split(",") if n] if a.only else archs.ARCHS
    if a.family:
        chosen = [x for x in chosen if x.family == a.family]
    columns = tuple(c for c in a.columns.split(",") if c)
    # (name, family, task, model reference): the suite, then a Llama-3 as torchtitan writes it (complex rotary,
    # loss outside), and torchtitan's own where it imports (its model package imports Triton).
    todo = [(x.name, x.family, x.task, f"arch:{x.name}") for x in chosen]
    if not a.only and not a.family:
        todo.append(("llama3 (torchtitan style)", "decoder", "causal-lm", "examples.models:llama3"))
        if importlib.util.find_spec("torchtitan") is not None:
            todo.append(("torchtitan llama3", "decoder", "causal-lm", "torchtitan:llama3"))
        else:
            print("# torchtitan is not importable here: its own Llama-3 is left out", file=sys.stderr)
    rows = []
    for name, family, task, ref in todo:
        row = sweep.sweep(ref, sweep.Row(name, family, task), columns, a.devices, a.tier,
                          say=print if a.verbose else None)
        rows.append(row)
        status = "  ".join(f"{c}={row.results.get(c, row.results.get('capture', ''))[:160]}" for c in columns)
        print(f"# {name:30s} {row.seconds:6.1f}s  {status}", file=sys.stderr, flush=True)
    print("\n".join(sweep.table(rows, columns)))
    print()
    print("\n".join(sweep.summary(rows, columns)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(sweep.rows_json(rows), f, indent=1)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
