"""Model references: ``pkg.module:fn``, ``path/file.py:fn`` or ``hf:NAME``; ``fn(**args)`` -> (model, example_inputs).

``hf:NAME`` is a Hugging Face ``transformers`` model type (``hf:gpt2``, ``hf:bert``, ``hf:llama``)
built with random weights from its config; see ``soybean.models.hf``.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parse_args(pairs: list[str]) -> dict[str, Any]:
    """``["hidden=64", "name=x"]`` -> ``{"hidden": 64, "name": "x"}`` (Python literals where they parse)."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise ValueError(f"bad --arg {p!r}: write key=value")
        k, v = p.split("=", 1)
        try:
            out[k.strip()] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k.strip()] = v
    return out


def resolve(ref: str) -> Callable[..., tuple]:
    """The factory function a reference names."""
    if ref.startswith("hf:"):
        from . import hf

        if not ref[3:]:
            raise ValueError(f"bad model reference {ref!r}: write hf:NAME, such as hf:gpt2")
        return hf.factory(ref[3:])
    if ":" not in ref:
        raise ValueError(f"bad model reference {ref!r}: write pkg.module:fn, path/file.py:fn or hf:NAME")
    mod_part, fn_name = ref.rsplit(":", 1)
    if mod_part.endswith(".py"):
        path = Path(mod_part)
        if not path.exists():
            raise ValueError(f"model file {mod_part} does not exist")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(mod)
    else:
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")  # let `examples.models:mlp` resolve from the working directory
        try:
            mod = importlib.import_module(mod_part)
        except ImportError as e:
            raise ValueError(f"cannot import model module {mod_part!r}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{mod_part} has no function {fn_name!r}")
    return fn


def load(ref: str, args: dict[str, Any] | None = None) -> tuple[Any, tuple]:
    fn = resolve(ref)
    try:
        res = fn(**(args or {}))
    except TypeError as e:
        raise ValueError(f"{ref}: {e}") from None
    if not (isinstance(res, tuple) and len(res) == 2):
        raise ValueError(f"{ref} must return (model, example_inputs)")
    model, inputs = res
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
