"""soybean: automatic tensor-tiling parallelizer for PyTorch."""
from .mesh import Mesh  # noqa: F401
from .tiling import Partial, Replicate, Shard  # noqa: F401

__version__ = "0.1.0"
