"""Sharding rules: one file per op family, one registry (``base.REGISTRY``).

Importing this package registers every family.  Ops without a rule get only the
all-Replicate strategy (the planner warns once, listing them).
"""
import importlib
import pkgutil

from .base import (  # noqa: F401
    REGISTRY,
    OpSpec,
    Strategy,
    Strategy1D,
    TensorSpec,
    expand,
    lookup,
    make_opspec,
    op_name,
    register,
    strategies_1d,
)

# Every module in this package other than the framework is a rule family.
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "validate"):
        importlib.import_module(f"{__name__}.{_m.name}")
