"""soybean: automatic tensor-tiling parallelizer for PyTorch."""
from .mesh import Mesh  # noqa: F401
from .tiling import Partial, Replicate, Shard  # noqa: F401

__version__ = "0.1.0"
from .plan import Plan  # noqa: F401,E402


def parallelize(*args, **kwargs):  # noqa: D103 - lazy import keeps `import soybean` light
    from .api import parallelize as _p

    return _p(*args, **kwargs)


def plan(*args, **kwargs):  # noqa: D103
    from .planner import plan as _p

    return _p(*args, **kwargs)
