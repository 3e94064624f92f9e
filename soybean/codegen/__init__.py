"""Codegen: lower a planned graph to one rank's fx.GraphModule (readable ``.code``)."""
from .lower import emit_files, lower  # noqa: F401
