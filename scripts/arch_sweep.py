"""The architecture sweep: Hugging Face architectures as loaded, trained with soybean and alone.

    python scripts/arch_sweep.py [--only gpt2,t5] [--family decoder] [--set suite|wider|all] [--devices 2]
                                 [--tier threads|gloo]
                                 [--columns check,time,comm] [--json out.json] [--write-docs docs/architectures.md]
    python scripts/arch_sweep.py --from-json out.json --tier gloo --write-docs docs/architectures.md

For each architecture of ``soybean.models.archs`` (``--set``: ``suite``, its ``ARCHS``, the ones the unit tests check
too; ``wider``, its ``WIDER``; ``all``, the default, both; tiny sizes, the config's defaults otherwise), and a Llama-3
written as torchtitan writes it (``examples.models:llama3``; torchtitan's own where it imports): ``check``
runs every strategy of every rule its graph uses on simulated ranks in float64 (``soybean check``); ``time``
and ``comm`` train it 3 AdamW steps with ``soybean.parallelize(model, kwargs, devices=N, objective=...)``,
every rank a thread (``--tier threads``) or a gloo process (``--tier gloo``), and compare the loss, every
gradient and every parameter with the model trained alone.  Prints a Markdown table (architecture, family,
equal to serial per column with the parameters the plan split, ops without a rule) and a summary.
``--write-docs PATH`` also writes them as the Markdown page the documentation links (``docs/architectures.md``);
``--from-json FILE`` writes it from the rows an earlier ``--json`` run saved, without running anything.

Your own model: ``soybean check pkg.module:fn --devices N`` runs the check column on it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import os
import sys
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soybean.verify import sweep
from soybean.models import archs

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "guide", "check.md")


def rows_from_json(data: list[dict[str, Any]]) -> list[sweep.Row]:
    """The rows a ``--json`` run saved (``sweep.rows_json``), back as ``sweep.Row``s."""
    return [sweep.Row(d["architecture"], d["family"], d["task"], dict(d["results"]), dict(d["split"]),
                      list(d["no_rule"]), float(d.get("seconds", 0.0))) for d in data]


def docs_page(rows: list[sweep.Row], columns: tuple[str, ...], *, path: str, date: str, command: str, tier: str,
              devices: int, note: str = "") -> str:
    """The sweep's results as the Markdown page written to ``path``: when and how they were measured, ``note``
    (what the run's reader should know beyond the table), the table and the summary.  The link to the guide that
    explains the suite is relative to ``path``, so the page's links resolve wherever it is written."""
    guide = os.path.relpath(GUIDE, os.path.dirname(os.path.abspath(path)))
    ranks = "gloo processes" if tier == "gloo" else "threads of one process"
    minutes = sum(r.seconds for r in rows) / 60
    took = f", the whole run in about {minutes:.0f} minutes" if minutes >= 1 else ""
    lines = [
        "# The architecture suite: results", "",
        "<!-- Written by scripts/arch_sweep.py --write-docs: rerun the sweep to refresh this page rather than"
        " editing it. -->", "",
        f"Measured on {date}: `{command}`, {devices} {ranks}, {sweep.STEPS} AdamW steps per objective{took}. "
        f"What each column checks and how \"equal\" is judged: [the guide]({guide}#the-architecture-suite). "
        "`time` and `comm` give how many of the model's parameters the plan splits.", "",
    ]
    if note:
        lines += [note, ""]
    lines += sweep.table(rows, columns)
    lines += ["", ", ".join(sweep.summary(rows, columns)) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated architecture names (default: all)")
    ap.add_argument("--family", default="", help=f"one family: {', '.join(archs.FAMILIES)}")
    ap.add_argument("--set", default="all", choices=("suite", "wider", "all"),
                    help="the suite's architectures (ARCHS), the wider net (WIDER) or both")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--tier", choices=("threads", "gloo"), default="threads")
    ap.add_argument("--columns", default="check,time,comm")
    ap.add_argument("--json", default="", help="also write the rows as JSON to this file")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of errors")
    ap.add_argument("--write-docs", default="", metavar="PATH",
                    help="also write the results as the documentation's Markdown page (docs/architectures.md)")
    ap.add_argument("--from-json", default="", metavar="FILE",
                    help="run nothing: take the rows an earlier --json run saved (for --write-docs)")
    ap.add_argument("--note", default="", help="a paragraph the --write-docs page shows above the table")
    ap.add_argument("--date", default=datetime.date.today().isoformat(), help="the run's date on the page")
    a = ap.parse_args(argv)
    columns = tuple(c for c in a.columns.split(",") if c)
    command = "python scripts/arch_sweep.py " + " ".join(
        x for x in (f"--tier {a.tier}", f"--devices {a.devices}" if a.devices != 2 else "",
                    f"--only {a.only}" if a.only else "", f"--family {a.family}" if a.family else "",
                    f"--set {a.set}" if a.set != "all" else "") if x)
    if a.from_json:
        with open(a.from_json) as f:
            rows = rows_from_json(json.load(f))
        if a.write_docs:
            _write(a.write_docs, docs_page(rows, columns, path=a.write_docs, date=a.date, command=command,
                                           tier=a.tier, devices=a.devices, note=a.note))
        return 0 if all(r.ok for r in rows) else 1
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    sets = {"suite": archs.ARCHS, "wider": archs.WIDER, "all": archs.ARCHS + archs.WIDER}
    chosen = [archs.BY_NAME[n] for n in a.only.split(",") if n] if a.only else sets[a.set]
    if a.family:
        chosen = [x for x in chosen if x.family == a.family]
    # (name, family, task, model reference): the suite, then a Llama-3 as torchtitan writes it (complex rotary,
    # loss outside), and torchtitan's own where it imports (its model package imports Triton).
    todo = [(x.name, x.family, x.task, f"arch:{x.name}") for x in chosen]
    if not a.only and not a.family and a.set != "wider":
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
    if a.write_docs:
        _write(a.write_docs, docs_page(rows, columns, path=a.write_docs, date=a.date, command=command, tier=a.tier,
                                       devices=a.devices, note=a.note))
    return 0 if all(r.ok for r in rows) else 1


def _write(path: str, text: str) -> None:
    """Write the docs page, saying where on stderr (stdout carries the table)."""
    with open(path, "w") as f:
        f.write(text)
    print(f"# wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
