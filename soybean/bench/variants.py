"""The bench's variants as one table: each row is everything the harness knows about one variant.

``prepare`` names how the variant wraps the model (the harness's ``_prepare_<prepare>``); ``contract`` says
what each rank passes: ``full``, the whole batch (serial, torch's tensor parallel, soybean's full-batch
contract), or ``local``, its dim-0 slice (DDP, FSDP2, soybean's ``local_batch``); ``loss_reference`` is the
variant whose first loss this one's must equal (serial's for a full batch; DDP's mean over the ranks' own
losses for soybean's local contract; None: not checked); ``replicates``: it may hold a whole replica of the
parameters on every rank (the memory estimate that decides whether variants take turns); soybean's rows carry
their planning options (``options.PlanOptions``' ``mode``, ``local_batch``, ``collectives``, and the kind of plan:
``pipeline``, a number of stages or ``auto``, planned by ``pipeline_plan`` / ``api.auto_plan`` and trained through
``train_step``; ``placement`` ``auto``: branches may run on their own device groups, where modelled faster), the
harness choosing what to plan from them as ``parallelize`` and the CLI do (``options.plan_kind``).

A new variant is one row here (and a ``_prepare_*`` in the harness when it wraps the model a new way).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    name: str
    prepare: str                      # serial, ddp, tp, fsdp, pp, soybean
    contract: str                     # full or local
    replicates: bool
    loss_reference: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)  # soybean's planning options (PlanOptions fields)

    @property
    def soybean(self) -> bool:
        return self.prepare == "soybean"


SERIAL = "serial"
TABLE: tuple[Variant, ...] = (
    Variant(SERIAL, "serial", "full", False),
    Variant("ddp", "ddp", "local", True),
    Variant("tp", "tp", "full", False, loss_reference=SERIAL),
    Variant("fsdp", "fsdp", "local", False),
    Variant("pp", "pp", "full", False, loss_reference=SERIAL),
    Variant("soybean", "soybean", "full", True, SERIAL, {"mode": "auto", "pipeline": "auto", "placement": "auto"}),
    Variant("soybean_dp", "soybean", "full", True, SERIAL, {"mode": "dp"}),
    Variant("soybean_mp", "soybean", "full", False, SERIAL, {"mode": "mp"}),
    Variant("soybean_local", "soybean", "local", True, "ddp", {"mode": "auto", "local_batch": True}),
    Variant("soybean_backend", "soybean", "full", True, SERIAL, {"mode": "auto", "collectives": "backend"}),
    Variant("soybean_pp", "soybean", "full", False, SERIAL, {"mode": "auto", "pipeline": 2}),
)
BY_NAME: dict[str, Variant] = {v.name: v for v in TABLE}

# Derived views, in table order.
VARIANTS: tuple[str, ...] = tuple(v.name for v in TABLE)
DIST_VARIANTS: tuple[str, ...] = tuple(v.name for v in TABLE if v.name != SERIAL)
SOYBEAN_MODES: dict[str, str] = {v.name: v.plan["mode"] for v in TABLE if v.soybean}
LOCAL_BATCH: frozenset[str] = frozenset(v.name for v in TABLE if v.soybean and v.contract == "local")
REPLICATING: frozenset[str] = frozenset(v.name for v in TABLE if v.replicates)
