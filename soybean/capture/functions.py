"""Custom ``torch.autograd.Function``s a captured model calls, named so the user hears of them.

``torch.export`` records a Function's forward as plain aten ops; soybean differentiates its own program of them,
so a Function trains with the derivative of its forward, never with its own ``backward``.  Where that backward is
the derivative (RecurrentGemma's ``SqrtBoundDerivative`` away from its bound) training is the serial one; where
it is something else (a gradient reversal returns ``-grad``, a straight-through estimator passes ``grad`` through a
rounding) it differs from serial.  The graph keeps no mark of the Function, only the source lines its ops came
from (``node.meta["stack_trace"]``), so the Functions are found by the lines of their ``forward``.
"""
from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterator

import torch
from torch import fx

# A frame of a node's stack trace, as torch's ``format_stack`` writes it.
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in forward')


class CustomFunctionWarning(UserWarning):
    """The model calls a custom ``torch.autograd.Function``: it trains with the derivative of its forward."""


def _subclasses(cls: type) -> Iterator[type]:
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _forward_lines() -> dict[str, list[tuple[int, int, type]]]:
    """Per source file, the line span of each user-defined Function's ``forward`` (not torch's or soybean's own,
    whose backwards are their forwards' derivatives or are not captured)."""
    spans: dict[str, list[tuple[int, int, type]]] = {}
    for cls in set(_subclasses(torch.autograd.Function)):
        if cls.__module__.split(".")[0] in ("torch", "soybean") or "backward" not in vars(cls):
            continue
        fwd = vars(cls).get("forward")
        fn = getattr(fwd, "__func__", fwd)
        if not callable(fn):
            continue
        try:
            lines, first = inspect.getsourcelines(fn)
            path = inspect.getsourcefile(fn)
        except (OSError, TypeError):
            continue
        if path is not None:
            spans.setdefault(path, []).append((first, first + len(lines) - 1, cls))
    return spans


def custom_functions(gm: fx.GraphModule) -> list[type]:
    """The user-defined ``autograd.Function`` classes whose ``forward`` ran some op of ``gm`` (by its nodes' stack
    traces), in the order first met."""
    spans = _forward_lines()
    if not spans:
        return []
    found: dict[type, None] = {}
    for n in gm.graph.nodes:
        for path, line in _FRAME.findall(n.meta.get("stack_trace") or ""):
            for first, last, cls in spans.get(path, ()):
                if first <= int(line) <= last:
                    found[cls] = None
    return list(found)


def warn_custom_functions(gm: fx.GraphModule, model: str) -> None:
    """One ``CustomFunctionWarning`` naming every user-defined Function ``gm``'s ops came from."""
    found = custom_functions(gm)
    if found:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in found)
        warnings.warn(
            f"{model} calls the custom torch.autograd.Function {names}: soybean trains the derivative of its "
            "forward, not its backward. Where the backward is something else (a gradient reversal, a "
            "straight-through estimator) training differs from serial: write that step with detach, "
            "as x + (q(x) - x).detach(), which the captured graph keeps", CustomFunctionWarning, stacklevel=3)
