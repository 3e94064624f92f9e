"""Memory: bytes per device that a tensor's tiling keeps.

A parameter keeps ``PARAM_COPIES`` copies of its local tile (itself, its gradient and AdamW's two
states); any other tensor, its local tile.
"""
from __future__ import annotations

# Adam/AdamW keep two states per parameter, plus the gradient: 4 copies in all.
PARAM_COPIES = 4
