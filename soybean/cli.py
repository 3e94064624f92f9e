"""``soybean`` command line: plan | explain | draw | diff | check | run | calibrate | bench."""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .capture.core import Captured
    from .options import PlanOptions
    from .plan import Plan
    from .report.explain import Explanation


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="pkg.module:fn or path/file.py:fn, fn(**args) returning (model, example_inputs); "
                                 "or hf:NAME, a Hugging Face model type (--arg: config overrides, batch, seq, meta)")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword for the model factory (repeatable)")


class ProgressLine:
    """One line on ``stream``, rewritten in place: ``[plan 12.3s] mesh 2x4: build and solve``.

    Silent for the first ``after_s`` seconds (quick plans print nothing), when not ``enabled``
    (``--quiet``) and when ``stream`` is not a terminal (logs and pipes get no carriage returns).
    """

    def __init__(self, stream: TextIO, enabled: bool = True, after_s: float = 2.0, label: str = "plan") -> None:
        self.stream, self.after_s, self.label = stream, after_s, label
        self.enabled = enabled and stream.isatty()
        self.t0 = time.perf_counter()
        self.last = ""
        self.shown = False

    def __call__(self, line: str) -> None:
        self.last = line
        elapsed = time.perf_counter() - self.t0
        if self.enabled and elapsed >= self.after_s:
            self.stream.write(f"\r[{self.label} {elapsed:5.1f}s] {line}".ljust(79)[:119] + "\x1b[K")
            self.stream.flush()
            self.shown = True

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.shown:  # leave the terminal on a fresh line
            self.stream.write("\n")
            self.stream.flush()


def _planned(progress: bool, *args: Any, **kwargs: Any) -> Plan:
    """``planner.plan(*args, **kwargs)`` with its progress line on stderr (``progress``), and soybean's warnings
    (the replicate fallback) printed there as one line each."""
    from .planner.core import plan

    line = ProgressLine(sys.stderr, enabled=progress)
    with warnings.catch_warnings(record=True) as caught, line:
        warnings.simplefilter("always")
        p = plan(*args, progress=line, **kwargs)
    for w in caught:
        if "soybean" in str(w.message):
            print(f"warning: {w.message}", file=sys.stderr)
    return p


def _kind(a: argparse.Namespace, given: Plan | None = None) -> str:
    """The kind of plan (``options.plan_kind``, the selector ``parallelize`` and the bench build by) the flags ask
    for, or the one ``given`` (``--plan``) runs as: the planning flags are then unused, as ``--plan`` says."""
    from .options import PlanOptions, plan_kind, plan_options

    return plan_kind(PlanOptions(), given) if given is not None else plan_kind(plan_options(a))


def _caching(a: argparse.Namespace) -> bool:
    """Whether the disk caches (captures, route walks: ``capture_cache``, ``route_cache``) are read and written."""
    from .capture import cache as capture_cache

    return capture_cache.enabled() and not getattr(a, "no_cache", False)


def _captured(a: argparse.Namespace, precision: str | None) -> tuple[Any, tuple, Captured]:
    """The model (None on a cache hit: it was not built), its inputs and its capture under ``precision``: from
    the capture cache (``capture_cache``) unless ``--no-cache``, else built and captured now (and stored)."""
    from . import models
    from .capture import cache as capture_cache
    from .capture.core import capture
    from .precision import policy

    name = policy(precision).name
    args = models.parse_args(a.arg)
    key = capture_cache.capture_key(a.model, args, name)
    use = _caching(a)
    if use and (cap := capture_cache.load(key)) is not None:
        return None, (), cap
    model, inputs = models.load(a.model, args)
    cap = capture(model, inputs, precision=name)
    if use:
        capture_cache.store(key, cap)
    return model, inputs, cap


def _plan_pipelined(a: argparse.Namespace, opts: PlanOptions) -> int:
    """``soybean plan --pipeline S``: the model captured at the microbatch, cut into ``S`` stages, each planned on
    its devices (``pipeline_plan.plan_pipeline``); ``--pipeline auto``: the faster of those searched and the plan
    without stages, placed where faster with ``--placement auto`` (``api.auto_plan``), as ``parallelize`` plans."""

    from . import models
    from .api import auto_plan, micro_inputs
    from .capture.core import capture
    from .parts.pipeline_plan import plan_pipeline
    from .precision import policy
    from .report.table import pipeline_table, placement_table, table

    model, inputs = models.load(a.model, models.parse_args(a.arg))
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    precision = policy(opts.precision).name
    if opts.pipeline == "auto":
        with ProgressLine(sys.stderr, enabled=not a.quiet) as line:
            p = auto_plan(model, args, {}, opts.one_program(), opts.world, precision, line, baselines=True,
                          placement=opts.placement == "auto")
    else:
        assert isinstance(opts.pipeline, int)
        stages, m = opts.pipeline, opts.microbatches_for(opts.pipeline)
        cap = capture(model, micro_inputs(args, {}, m)[0], precision=precision)
        _, _, p = plan_pipeline(cap, opts.world, stages, m, opts.schedule, opts.one_program(), opts.virtual)
    _write_plan(a, p, p.to_json() if a.format == "json" else pipeline_table(p) if p.pipeline is not None else
                placement_table(p) if p.placement is not None else table(p))
    return 0


def _write_plan(a: argparse.Namespace, p: Plan, text: str) -> None:
    """``text`` (the plan as ``--format`` shows it) to ``--out`` (the JSON when its name ends in ``.json``) and,
    without ``--out`` or as a table, to stdout."""
    if a.out:
        with open(a.out, "w") as f:
            f.write(p.to_json() if a.out.endswith(".json") else text)
    if not a.out or a.format == "table":
        sys.stdout.write(text)


def _cmd_plan(a: argparse.Namespace) -> int:
    from .capture.core import CaptureError
    from .options import plan_kind, plan_options
    from .report.table import table

    opts = plan_options(a)  # every option checked here, before the model is built
    kind, one = plan_kind(opts), opts.one_program()
    if kind in ("pipelined", "auto"):
        return _plan_pipelined(a, opts)
    try:
        model, inputs, cap = _captured(a, opts.precision)
        if cap.functions:
            _pieces_if_own_backwards(a, model, inputs, cap.functions, kind, opts.precision or "fp32")
    except CaptureError as e:  # captured by dynamo in pieces, as parallelize captures it
        from .report.table import pieces_table

        p = _pieces_plan(a, opts, e)[0]
        _write_plan(a, p, p.to_json() if a.format == "json" else pieces_table(p))
        return 0
    if kind == "placed":
        from .api import placed_or_plain
        from .report.table import placement_table

        with ProgressLine(sys.stderr, enabled=not a.quiet) as line:
            p = placed_or_plain(cap, opts.world, one, line, baselines=True, cache_routes=_caching(a))
        _write_plan(a, p, p.to_json() if a.format == "json" else
                    placement_table(p) if p.placement is not None else table(p))
        return 0
    p = _planned(not a.quiet, model, inputs, options=one, captured=cap, cache_routes=_caching(a))
    _write_plan(a, p, p.to_json() if a.format == "json" else table(p))
    _warn_over_device(p, one)
    if a.emit_code:
        from . import models
        from .codegen import emit_files

        if model is None:  # a cached capture: the program is generated from the model itself
            model, inputs = models.load(a.model, models.parse_args(a.arg))
        for path in emit_files(model, inputs, p, a.emit_code):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _warn_over_device(p: Plan, opts: PlanOptions) -> None:
    """On stderr, where no memory budget was given and the plan's modelled peak is over the profile's device memory:
    the plan may not run there, and ``--memory-gb`` plans within it (dots.llm1's default config: 393 GiB a device on
    the 80 GiB H100 profile, printed without a word)."""
    from .cost.memory import GIB
    from .cost.profiles import Profile, load_profile

    peak = p.memory.get("peak") if p.memory else None
    if opts.memory_gb is not None or not isinstance(peak, (int, float)):
        return
    prof = opts.profile if isinstance(opts.profile, Profile) else load_profile(opts.profile)
    if peak > prof.memory_gb * GIB:
        print(f"soybean plan: warning: the plan's modelled peak, {peak / GIB:.4g} GiB per device, is over "
              f"{prof.name}'s {prof.memory_gb:g} GiB: give --memory-gb {prof.memory_gb:g} to plan within it",
              file=sys.stderr)


def _pieces_if_own_backwards(a: argparse.Namespace, model: Any, inputs: Any, functions: tuple[str, ...], kind: str,
                             precision: str) -> None:
    """Raise the ``CaptureError`` that plans the model in pieces where a custom Function it calls (``functions``)
    must run as written, by ``parallelize``'s rule (``capture.functions.pieces_or_whole``): its error or warning
    where pieces are not offered (a placed plan, bf16)."""
    from . import models
    from .capture.core import CaptureError, split_example
    from .capture.functions import kept_whole_by, own_backwards, pieces_or_whole

    if model is None:  # a cached capture: the model itself runs the check
        model, inputs = models.load(a.model, models.parse_args(a.arg))
    own = own_backwards(model, *split_example(inputs, None), functions)
    reason = pieces_or_whole(own, type(model).__name__, kept_whole_by("auto", kind=kind, precision=precision), False)
    if reason is not None:
        raise CaptureError(reason)


def _pieces_plan(a: argparse.Namespace, opts: PlanOptions, err: Exception, given: Plan | None = None
                 ) -> tuple[Plan, list[Captured]]:
    """A model ``torch.export`` could not capture (``err``), as ``parallelize`` plans it: its pieces captured by
    dynamo (``soybean.run.pieces``) and planned each (or ``given``'s plans, checked against them); the plan and the
    pieces' captures, one per plan."""
    from . import models
    from .capture.core import split_example
    from .run.pieces import collect, distinct, pieces_fingerprint, plan_pieces

    if opts.precision not in (None, "fp32"):
        raise ValueError(f"the model is captured by dynamo in pieces ({err}): only fp32 is offered there")
    if given is None and opts.placement == "auto":  # as ``parallelize`` refuses it
        raise ValueError(f"the model is captured by dynamo in pieces ({err}): placement is not offered there; drop "
                         "--placement")
    model, inputs = models.load(a.model, models.parse_args(a.arg))
    args, kwargs = split_example(inputs, None)
    pieces = distinct(collect(model, args, kwargs))
    caps = [cap for _, cap in pieces]
    why = str(err).split(". Fix:")[0]
    if given is None:
        p = plan_pieces(model, pieces, opts.world, opts.one_program(), why,
                        lambda cap, o, world: _planned(not a.quiet, None, (), world, options=o, captured=cap,
                                                       baselines=False))
    else:
        p = given
        mine = pieces_fingerprint([c.fingerprint for c in caps])
        if given.pieces is None or mine != given.fingerprint:
            raise ValueError(f"the plan was made for another model or other input shapes (fingerprint "
                             f"{given.fingerprint} != {mine}): give the model and --arg it was planned with")
    return p, caps


def _explained(a: argparse.Namespace) -> list[tuple[str, Explanation, list[int] | None]]:
    """``explain`` and ``draw``: the model's plan (``--plan``: a saved one, checked against the model; else
    planned now as ``soybean plan`` would) and its rows on the plan's full candidate table; a pipelined plan
    (``--plan`` of one, or ``--pipeline S``), one per stage, each titled by its stage's row of the table."""
    from . import models
    from .capture.core import CaptureError, capture
    from .cost.profiles import load_profile
    from .options import plan_options
    from .plan import Plan
    from .precision import policy
    from .report.explain import explain

    model, inputs = models.load(a.model, models.parse_args(a.arg))
    profile = load_profile(a.profile) if a.profile else None
    given = Plan.load(a.plan) if a.plan else None
    kind = _kind(a, given)
    if kind in ("pipelined", "auto"):
        return _explained_stages(a, model, inputs, given, profile)
    if kind == "placed":
        return _explained_regions(a, model, inputs, given, profile)
    try:
        functions = capture(model, inputs).functions
        if functions and (given is None or given.pieces is not None):  # in pieces, as ``soybean plan`` plans it
            precision = (plan_options(a).precision or "fp32") if given is None else "fp32"
            _pieces_if_own_backwards(a, model, inputs, functions, "plain", precision)
    except CaptureError as e:  # a plan made of pieces: one part per piece
        from .run.pieces import piece_plans

        if given is None and a.devices is None:
            raise ValueError("give --devices P to plan the model, or a saved plan with --plan") from None
        p, caps = _pieces_plan(a, plan_options(a), e, given)
        assert p.pieces is not None
        return [(f"{row['ops']} ops, {len(row['params'])} parameters", explain(cap, part, profile), None)
                for row, cap, part in zip(p.pieces["graphs"], caps, piece_plans(p))]
    if a.plan:
        p = Plan.load(a.plan)
        if a.devices is not None and a.devices != p.devices:
            raise ValueError(f"--devices {a.devices} but the plan {a.plan} is for {p.devices} devices: drop --devices")
        cap = capture(model, inputs, precision=p.precision)
        if cap.fingerprint != p.fingerprint:
            raise ValueError(f"the plan {a.plan} was made for another model or other input shapes (fingerprint "
                             f"{p.fingerprint} != {cap.fingerprint}): give the model and --arg it was planned with")
    else:
        if a.devices is None:
            raise ValueError("give --devices P to plan the model, or a saved plan with --plan")
        opts = plan_options(a)
        cap = capture(model, inputs, precision=policy(opts.precision).name)
        p = _planned(True, None, (), options=opts, captured=cap, baselines=False)
    return [("", explain(cap, p, profile), None)]


def _explained_regions(a: argparse.Namespace, model: Any, inputs: Any, given: Plan | None,
                       profile: Any) -> list[tuple[str, Explanation, list[int] | None]]:
    """Each region of a placed plan explained on its own capture and plan, titled by its row of the table and
    the regions it runs at the same time as (a plan without placement: explained whole)."""
    from .api import placed_or_plain
    from .capture.core import capture
    from .options import plan_options
    from .parts.rebuild import parts_of
    from .precision import policy
    from .report.explain import explain
    from .report.table import placement_table

    if given is None:
        if a.devices is None:
            raise ValueError("give --devices P to plan the model, or a saved plan with --plan")
        opts = plan_options(a)
        cap = capture(model, inputs, precision=policy(opts.precision).name)
        p = placed_or_plain(cap, opts.world, opts.one_program())
    else:
        p = given
        cap = capture(model, inputs, precision=p.precision)
        if cap.fingerprint != p.fingerprint:
            raise ValueError(f"the plan {a.plan} was made for another model or other input shapes (fingerprint "
                             f"{p.fingerprint} != {cap.fingerprint}): give the model and --arg it was planned with")
    if p.placement is None:
        return [("", explain(cap, p, profile), None)]
    rows = p.placement["regions"]
    regions, plans = parts_of(cap, p)
    table = placement_table(p).splitlines()
    out: list[tuple[str, Explanation, list[int] | None]] = []
    for k, (reg, rp, row) in enumerate(zip(regions, plans, rows)):
        along = [j for j, r in enumerate(rows)
                 if j != k and r["segment"] is not None and r["segment"] == row["segment"]]
        overlap = f"runs at the same time as region {', '.join(map(str, along))}" if along else "runs alone"
        out.append((f"{table[0]}\n{table[k + 1]}\n{overlap}", explain(reg.cap, rp, profile), list(row["ranks"])))
    return out


def _explained_stages(a: argparse.Namespace, model: Any, inputs: Any, given: Plan | None,
                      profile: Any) -> list[tuple[str, Explanation, list[int] | None]]:
    """Each stage of a pipelined plan explained on its own capture and plan, titled by its row of the table."""
    from .api import micro_inputs
    from .capture.core import capture
    from .options import plan_options
    from .parts.part import Part
    from .parts.pipeline_plan import plan_pipeline
    from .parts.rebuild import parts_of
    from .precision import policy
    from .report.explain import explain
    from .report.table import pipeline_table

    args = inputs if isinstance(inputs, tuple) else (inputs,)
    cut: list[Part]
    plans: list[Plan]
    if given is None:
        opts = plan_options(a)
        if not isinstance(opts.pipeline, int):
            raise ValueError("explain and draw take --pipeline S (a number of stages), or a plan saved by "
                             "`soybean plan --pipeline auto --out plan.json` with --plan")
        stages = opts.pipeline
        m = opts.microbatches_for(stages)
        cap = capture(model, micro_inputs(args, {}, m)[0], precision=policy(opts.precision).name)
        stage_cut, plans, p = plan_pipeline(cap, opts.world, stages, m, opts.schedule, opts.one_program(),
                                            opts.virtual)
        cut = list(stage_cut)
    else:
        p = given
        assert p.pipeline is not None
        cap = capture(model, micro_inputs(args, {}, int(p.pipeline["microbatches"]))[0], precision=p.precision)
        if cap.fingerprint != p.fingerprint:
            raise ValueError(f"the plan {a.plan} was made for another model or other input shapes (fingerprint "
                             f"{p.fingerprint} != {cap.fingerprint}): give the model and --arg it was planned with")
        cut, plans = parts_of(cap, p)
    assert p.pipeline is not None
    rows = pipeline_table(p).splitlines()
    return [(f"{rows[0]}\n{rows[k + 1]}\n{rows[-1]}", explain(st.cap, sp, profile), None)
            for k, (st, sp) in enumerate(zip(cut, plans))]


def _part_kind(a: argparse.Namespace) -> str:
    """What one part of an explained plan is: a placed plan's region or a pipelined plan's stage."""
    from .plan import Plan

    given = Plan.load(a.plan) if a.plan else None
    kind = _kind(a, given)
    if kind == "plain":
        return "piece"  # (only a plan of parts is asked its kind: without stages or regions, it is made of pieces)
    return "region" if kind == "placed" else "pipeline stage"


def _cmd_explain(a: argparse.Namespace) -> int:
    from .report.explain import format_text

    kind = _part_kind(a)
    for k, (title, ex, _) in enumerate(_explained(a)):
        if title:
            sys.stdout.write(f"{'' if k == 0 else chr(10)}== {kind} {k}\n{title}\n\n")
        sys.stdout.write(format_text(ex, a.node))
    return 0


def _cmd_draw(a: argparse.Namespace) -> int:
    from .report.draw import group_colours, page, stacked, svg

    parts = _explained(a)
    with open(a.out, "w") as f:
        if len(parts) == 1 and not parts[0][0]:
            f.write(page(parts[0][1]) if a.out.endswith(".html") else svg(parts[0][1]))
        else:
            kind = _part_kind(a)
            colours = None
            if kind == "region":  # each region's band in its device group's colour
                ranks = [r or [] for _, _, r in parts]
                colours = group_colours(ranks, max(max(r) for r in ranks) + 1)
            f.write(stacked([(t, ex) for t, ex, _ in parts], html_page=a.out.endswith(".html"), kind=kind,
                            colours=colours))
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


def _cmd_diff(a: argparse.Namespace) -> int:
    """Exit 0 when the plans are the same (nothing printed), 1 when they differ, as ``diff``."""
    from .plan import Plan
    from .report.plandiff import diff

    lines = diff(Plan.load(a.a), Plan.load(a.b))
    if lines:
        sys.stdout.write("\n".join(lines) + "\n")
    return 1 if lines else 0


def _add_explained_args(p: argparse.ArgumentParser) -> None:
    """The arguments ``explain`` and ``draw`` share: the model, and its plan saved or planned now."""
    from .options import add_plan_options

    _add_model_args(p)
    p.add_argument("--plan", metavar="PLAN.json",
                   help="a plan saved by `soybean plan --out`: its tilings are read, not planned again (the "
                        "planning options below are then unused, but --profile)")
    add_plan_options(p, profile_help="; with --plan, default the plan's")


def _cmd_run(a: argparse.Namespace) -> int:
    """Run ``script`` as ``nproc`` local ranks with torchrun's environment (gloo on CPU)."""
    import os
    import subprocess
    import time

    from .runtime.launch import free_port

    if a.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {a.nproc}")
    if not os.path.exists(a.script):
        raise ValueError(f"script {a.script} does not exist")
    port = free_port()
    procs = []
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_WORLD_SIZE=str(a.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, a.script, *a.script_args], env=env))
    deadline = time.monotonic() + a.timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                r, c = bad[0]
                print(f"soybean run: rank {r} exited with code {c}; stopping the others", file=sys.stderr)
                return c or 1
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"soybean run: still running after {a.timeout:.0f} s; stopping all ranks", file=sys.stderr)
                return 124
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _cmd_check(a: argparse.Namespace) -> int:
    """Exit 0 when every strategy of every rule the model's graph uses is exact on the meshes, 1 when one is not."""
    import json
    import logging

    from . import models
    from .mesh import Mesh
    from .verify.check import check_model

    if a.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {a.devices}")
    meshes = [Mesh.parse(a.mesh).shape] if a.mesh else None
    if meshes and Mesh(meshes[0]).size != a.devices:
        raise ValueError(f"mesh {a.mesh} has {Mesh(meshes[0]).size} devices, not {a.devices}")
    model, inputs = models.load(a.model, models.parse_args(a.arg))
    logging.getLogger("torch").setLevel(logging.ERROR)  # export's own chatter about fake tensors
    line = ProgressLine(sys.stderr, enabled=not a.quiet, label="check")
    with warnings.catch_warnings(), line:
        warnings.simplefilter("ignore")
        report = check_model(model, inputs, devices=a.devices, meshes=meshes, every_node=a.every_node, progress=line)
    if a.format == "json":
        print(json.dumps({"ok": report.ok, "meshes": [list(m) for m in report.meshes], "dtype": report.dtype,
                          "ops": report.ops, "nodes": report.nodes, "strategies": report.strategies,
                          "failures": [vars(f) for f in report.failures], "no_rule": report.unruled,
                          "forward_only": report.forward_only, "not_checked": report.random}, indent=1))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def _cmd_calibrate(a: argparse.Namespace) -> int:
    from .bench.calibrate import main_cli

    return main_cli(a.devices, a.out, a.reps)


def _cmd_bench(a: argparse.Namespace) -> int:
    from .bench.harness import cmd_bench  # here, not when the parser is built: it imports the runtime and codegen

    return cmd_bench(a)


def build_parser() -> argparse.ArgumentParser:
    from .options import add_plan_options

    ap = argparse.ArgumentParser(prog="soybean", description="Automatic tensor-tiling parallelizer for PyTorch")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="find the optimal tiling of every tensor and show it")
    _add_model_args(p)
    add_plan_options(p, devices_required=True)
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--out", help="write the plan here (JSON when the name ends in .json)")
    p.add_argument("--emit-code", metavar="DIR", help="write each rank's generated program to DIR")
    p.add_argument("--no-cache", action="store_true",
                   help="capture the model and walk its routes afresh, neither reading nor writing the capture "
                   "and route caches (~/.cache/soybean)")
    p.set_defaults(fn=_cmd_plan)
    e = sub.add_parser("explain", help="why each tiling: every op's cost split, and its next-best strategy")
    _add_explained_args(e)
    e.add_argument("--node", metavar="NAME", help="only this op, parameter FQN or module (and the modules inside it)")
    e.set_defaults(fn=_cmd_explain)
    d = sub.add_parser("draw", help="draw the plan: tensors coloured by tiling, collectives marked, time bars")
    _add_explained_args(d)
    d.add_argument("--out", required=True, help="plan.svg, or plan.html for a page with the explanation")
    d.set_defaults(fn=_cmd_draw)
    f = sub.add_parser("diff", help="what differs between two saved plans (exit 0: same, 1: they differ)")
    f.add_argument("a", metavar="A.json")
    f.add_argument("b", metavar="B.json")
    f.set_defaults(fn=_cmd_diff)
    r = sub.add_parser("run", help="run a training script on N local processes (torchrun's environment, gloo on CPU)")
    r.add_argument("--nproc", type=int, default=2)
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds before every rank is stopped")
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=_cmd_run)
    k = sub.add_parser("check", help="run every strategy of every rule the model uses on simulated ranks against the "
                                     "serial op, forward and backward in float64 (exit 0: all exact, 1: not)")
    _add_model_args(k)
    k.add_argument("--devices", type=int, default=2, help="check the strategies of every mesh of this many devices")
    k.add_argument("--mesh", help="only this mesh shape, such as 2x2")
    k.add_argument("--every-node", action="store_true",
                   help="check every op node (default: each distinct op, arguments and shapes once)")
    k.add_argument("--format", choices=["table", "json"], default="table")
    k.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    k.set_defaults(fn=_cmd_check)
    c = sub.add_parser("calibrate", help="measure collectives and compute here; write a profile for --profile")
    c.add_argument("--devices", type=int, default=2)
    c.add_argument("--out", help="profile JSON to write (default: print it)")
    c.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (median)")
    c.set_defaults(fn=_cmd_calibrate)
    from .bench.args import add_parser as add_bench

    add_bench(sub, _cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"soybean {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # capture errors and the like: one line, not a traceback
        from .capture.core import CaptureError

        if isinstance(e, CaptureError):
            print(f"soybean {a.cmd}: error: {e}", file=sys.stderr)
            return 2
        raise


def entry() -> None:
    """The ``soybean`` command: ``main``, then exit without tearing the interpreter down.  Freeing a
    large model's planning tables object by object took 6 s of a 43 s Llama-3-8B plan; everything the
    command writes is flushed first, and nothing else needs the teardown (tests call ``main``)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
