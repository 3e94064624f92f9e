"""soybean: automatic tensor-tiling parallelizer for PyTorch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .mesh import Mesh
from .plan import Plan
from .tiling import Partial, Replicate, Shard

if TYPE_CHECKING:
    from pathlib import Path

    from .run.module import ParallelModule

__all__ = ["Mesh", "Partial", "Plan", "Replicate", "Shard", "compile_backend", "latest_checkpoint", "parallelize",
           "plan"]
__version__ = "0.1.0"


# The two entry points import their modules when called: `import soybean` stays light (no capture,
# planner, solver or runtime), and the core never has to import this facade.
def parallelize(*args: Any, **kwargs: Any) -> ParallelModule:
    from .api import parallelize as _p

    return _p(*args, **kwargs)


def plan(*args: Any, **kwargs: Any) -> Plan:
    from .planner.core import plan as _p

    return _p(*args, **kwargs)


def compile_backend(*args: Any, **kwargs: Any) -> Any:
    """``torch.compile(model, backend=soybean.compile_backend())``: see ``soybean.compile``."""
    from .compile import compile_backend as _c

    return _c(*args, **kwargs)


def latest_checkpoint(path: Any) -> Path | None:
    """The checkpoint ``ParallelModule.load_sharded(path)`` would read: the newest complete one under directory
    ``path`` (or ``path`` itself when it is one), None when there is none yet; what a resumable loop asks at
    start."""
    from .runtime.checkpoint_dir import latest

    return latest(path)
