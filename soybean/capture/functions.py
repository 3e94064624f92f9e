"""Custom ``torch.autograd.Function``s a captured model calls, found so that their own ``backward`` is kept.

``torch.export`` records a Function's forward as plain aten ops; a program differentiated from them trains with
the derivative of the Function's forward, never with its own ``backward``.  Where that backward is the derivative
(RecurrentGemma's ``SqrtBoundDerivative`` away from its bound) training is the serial one; where it is something
else (a gradient reversal returns ``-grad``, a straight-through estimator passes ``grad`` through a rounding, YOSO's
attention has an approximate backward) it differs.  So ``parallelize`` (``capture_with="auto"``) checks each
Function's backward on the example (``own_backwards``) and captures a model whose Function differs (or could not be
checked) by dynamo in pieces instead, the Function run between them as written (``soybean.run.pieces``); where
pieces are not offered (pipeline stages, placement, a precision other than fp32) a backward shown to differ is a
``CustomFunctionError``, one not checked a ``CustomFunctionWarning`` (``exported_with``).  The graph keeps no mark
of the Function, so capture records the Functions the model calls while it is exported (``called_functions``).
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.function import _SingleLevelFunction
from torch.utils._pytree import tree_flatten, tree_map

from .eager import untouched


class CustomFunctionError(ValueError):
    """A custom ``torch.autograd.Function`` whose backward is not its forward's derivative, where the model can
    only be exported whole (pipeline stages, placement, bf16): the training would not be serial's."""


class CustomFunctionWarning(UserWarning):
    """The model calls a custom ``torch.autograd.Function``: it trains with the derivative of its forward."""


def _subclasses(cls: type) -> Iterator[type]:
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _user_functions() -> list[type]:
    """The user-defined Functions with a ``backward`` of their own (not torch's or soybean's, whose backwards are
    their forwards' derivatives or are not captured), each class once."""
    return sorted({cls for cls in _subclasses(torch.autograd.Function)
                   if cls.__module__.split(".")[0] not in ("torch", "soybean") and "backward" in vars(cls)},
                  key=lambda c: f"{c.__module__}.{c.__qualname__}")


@contextmanager
def _on_apply(classes: Sequence[Any], seen: Callable[[Any, tuple, dict], None]) -> Iterator[None]:
    """While open, each Function of ``classes`` calls ``seen(cls, args, kwargs)`` before its own ``apply``; ``apply``
    is as before afterwards (what ``called_functions`` and ``own_backwards`` watch a model's Functions by)."""
    saved = {c: vars(c).get("apply") for c in classes}

    def watched(cls: Any) -> Any:
        own = cls.apply

        def apply(*args: Any, **kwargs: Any) -> Any:
            seen(cls, args, kwargs)
            return own(*args, **kwargs)
        return staticmethod(apply)

    try:
        for c in classes:
            c.apply = watched(c)
        yield
    finally:
        for c, a in saved.items():
            if a is None:
                delattr(c, "apply")
            else:
                c.apply = a


@contextmanager
def called_functions() -> Iterator[dict[str, None]]:
    """While open, the user-defined Functions (``_user_functions``) this thread calls through ``apply``, by
    qualified name in the order first called (what ``Captured.functions`` records): ``capture`` opens it around
    ``torch.export``, whose graph keeps no mark of a Function, only its forward's ops.  (Found before by the source
    lines of each node's stack trace; recording the stack traces was 15-40% of an export.)  A call from another
    thread (a simulated rank running the model meanwhile) is not this capture's."""
    me = threading.get_ident()
    called: dict[str, None] = {}

    def seen(cls: Any, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() == me:
            called.setdefault(f"{cls.__module__}.{cls.__qualname__}")

    with _on_apply(_user_functions(), seen):
        yield called


def warn_custom_functions(names: Sequence[str], model: str, where: str) -> None:
    """One ``CustomFunctionWarning`` naming the Functions ``names`` that ``model`` calls, trained with the derivative
    of their forward because ``where`` (what kept them from running as written)."""
    if names:
        warnings.warn(
            f"{model} calls the custom torch.autograd.Function {', '.join(names)}: {where}, soybean trains the "
            "derivative of its forward, not its backward. Where the backward is something else (a gradient "
            "reversal, a straight-through estimator) training differs from serial: train without it (fp32, no "
            "pipeline= or placement=, capture_with='auto'), where it runs as written, or write that step with "
            "detach, as x + (q(x) - x).detach()", CustomFunctionWarning, stacklevel=3)


def pieces_reason(names: Sequence[str]) -> str:
    """Why a model that calls the custom Functions ``names`` is captured by dynamo in pieces (the plan's
    ``pieces.why`` and ``parallelize``'s warning)."""
    return (f"it calls the custom torch.autograd.Function {', '.join(names)}, which runs as written between the "
            "pieces, with its own backward")


class _Ctx:
    """What a Function's ``forward(ctx, ...)`` is given where it runs as plain code (``_matches``): the methods it
    may call, doing nothing, and any attribute it sets."""

    def __init__(self, n: int) -> None:
        self.needs_input_grad = (True,) * n
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        pass

    def mark_dirty(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _first_calls(classes: Sequence[Any], calls: dict[Any, tuple]) -> Any:
    """While open, the first call of each Function of ``classes`` through its ``apply`` is kept in ``calls``
    (its arguments, detached); ``apply`` is as before afterwards (``_on_apply``)."""
    def seen(cls: Any, args: tuple, kwargs: dict) -> None:
        if cls not in calls:
            calls[cls] = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, (args, kwargs))

    return _on_apply(classes, seen)


def _matches(cls: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``cls``'s own backward gives its forward's derivative at ``args``: one vector-Jacobian product of
    each, by a fixed random cotangent ``v``, ``backward(v)`` against ``autograd.grad(forward(args), args, v)``
    (the forward run as plain code, recorded), to float32 round-off."""
    def fresh() -> tuple[tuple, list[torch.Tensor]]:
        a = tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point())
                     if isinstance(t, torch.Tensor) else t, args)
        return a, [t for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor) and t.requires_grad]

    with torch.enable_grad():
        a1, in1 = fresh()
        own = tree_flatten(cls.apply(*a1, **kwargs))[0]
        a2, in2 = fresh()
        plain = cls.forward(*a2, **kwargs) if cls.setup_context is not _SingleLevelFunction.setup_context else \
            cls.forward(_Ctx(len(a2)), *a2, **kwargs)  # a forward without ctx: its ``setup_context`` is its own
        mine = tree_flatten(plain)[0]
        if len(own) != len(mine) or not in1:
            return False
        gen = torch.Generator().manual_seed(0)
        pairs = [(o, m) for o, m in zip(own, mine) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not pairs or any(not (isinstance(m, torch.Tensor) and m.requires_grad) for _, m in pairs):
            return False
        vs = [torch.randn(o.shape, generator=gen).to(o) for o, _ in pairs]
        g1 = torch.autograd.grad([o for o, _ in pairs], in1, vs, allow_unused=True)
        g2 = torch.autograd.grad([m for _, m in pairs], in2, vs, allow_unused=True)
    for x, y, t in zip(g1, g2, in1):
        x = torch.zeros_like(t) if x is None else x
        y = torch.zeros_like(t) if y is None else y
        if not torch.allclose(x.double(), y.double(), rtol=1e-4, atol=1e-6 * (1.0 + float(y.abs().max()))):
            return False
    return True


def own_backwards(model: torch.nn.Module, args: tuple, kwargs: dict, names: Sequence[str]) -> dict[str, bool]:
    """The Functions among ``names`` (``Captured.functions``) whose own backward must run, as written, each with
    whether it was shown to differ: True where its first call on the example (the model run once without grad, its
    buffers and random state kept) has a backward that is not its forward's derivative there (``_matches``),
    False where it could not be checked (a model on the meta device, a Function called other than through
    ``apply``, a forward that cannot run as plain code).  A Function whose backward matched is left out."""
    by_name = {f"{c.__module__}.{c.__qualname__}": c for c in _subclasses(torch.autograd.Function)}
    classes = [by_name[n] for n in names if n in by_name]
    if len(classes) < len(names) or any(t.is_meta for t in model.parameters()):
        return dict.fromkeys(names, False)
    calls: dict[Any, tuple] = {}
    try:
        with untouched(model), torch.no_grad(), _first_calls(classes, calls):
            model(*args, **kwargs)
    except Exception:  # the example did not run eagerly: nothing is known of the backwards
        return dict.fromkeys(names, False)
    out: dict[str, bool] = {}
    for name, cls in zip(names, classes):
        if cls not in calls:
            out[name] = False
            continue
        try:
            if not _matches(cls, *calls[cls]):
                out[name] = True
        except Exception:  # a forward that needs more of ctx, or of autograd, than plain code gives
            out[name] = False
    return out


def kept_whole_by(capture_with: str, *, given_plan: bool = False, kind: str = "plain", precision: str = "fp32",
                  simulated: bool = False) -> str | None:
    """Why a model that calls a custom Function is exported whole rather than captured in pieces where the Function
    runs as written: pieces are offered only to ``capture_with="auto"``, fp32, a plain plan made here, on a real
    process group.  None when nothing keeps it from pieces (the one rule ``parallelize`` and the CLI follow)."""
    if capture_with == "export":
        return "captured by torch.export as asked (capture_with='export')"
    if given_plan:
        return "under a plan made from its exported graph"
    if kind == "placed":
        return "placed (placement=)"
    if precision != "fp32":
        return f"in precision {precision}"
    if simulated:
        return "on simulated groups"
    return None


def pieces_or_whole(own: dict[str, bool], model: str, kept: str | None, asked: bool) -> str | None:
    """What becomes of a model whose Functions ``own`` (``own_backwards``) must run as written: the reason it is
    captured in pieces (``pieces_reason``) where nothing ``kept`` it whole (``kept_whole_by``); else None, after
    ``exported_with``'s error or warning."""
    if own and kept is None:
        return pieces_reason(list(own))
    if own:
        exported_with(own, model, kept or "", asked)
    return None


def exported_with(own: dict[str, bool], model: str, where: str, asked: bool) -> None:
    """A model exported whole though it calls the Functions ``own`` (``own_backwards``) because ``where``: an error
    naming those shown to differ (training would not be serial's) unless export was ``asked`` for, a
    ``CustomFunctionWarning`` for the rest."""
    differ = [n for n, shown in own.items() if shown and not asked]
    if differ:
        raise CustomFunctionError(
            f"{model} calls the custom torch.autograd.Function {', '.join(differ)}, whose backward is not the "
            f"derivative of its forward (checked on the example): {where}, soybean would train that derivative, "
            "not serial's gradients. Fix: train without it (fp32, no pipeline= or placement=, capture_with='auto') "
            "where the Function runs as written between pieces, or pass capture_with='export' to train the "
            "forward's derivative, or write the step with detach, as x + (q(x) - x).detach()")
    warn_custom_functions([n for n in own if n not in differ], model, where)
