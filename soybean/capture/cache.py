"""A cache of captures on disk, so that iterating on planning options does not export the model again.

``soybean plan`` spends seconds before planning starts: importing and building the model (transformers builds a
Llama on the meta device in ~2.5 s) and ``torch.export`` (1-4 s).  Neither changes while a user tries meshes,
budgets, profiles or objectives.  The command line looks its capture up before it builds the model, by a key of
everything the capture depends on: the model reference and its arguments, the factory's source (a file's bytes or
a module's), the precision, soybean's own source (``code_digest``) and the versions of soybean, torch and
transformers (``capture_key``).  A hit skips
both; a miss captures and stores.  ``--no-cache`` (or ``SOYBEAN_NO_CACHE=1``) skips the cache.

The captured graph is stored as data, not as pickled ``fx`` objects (those drop node metadata): each node's
name, kind, target (an aten overload by name, any other callable by module and qualified name), arguments with
node references by name, and the metadata planning reads (``val`` as shape, stride and dtype, rebuilt as meta
tensors; the module stack; soybean's own marks).  Files live under ``$SOYBEAN_CACHE_DIR``, else
``$XDG_CACHE_HOME/soybean``, else ``~/.cache/soybean``; a file that cannot be read is ignored and replaced.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import fx

from ..rules.base import DYNAMIC, tensor_dynamic
from ..rules.datadep import SIZES
from .core import Captured
from .passes.mark_returned_sums import RETURNED_SUM

FORMAT = 4  # bump when the stored form changes
_META_KEYS = ("nn_module_stack", "stack_trace", RETURNED_SUM, SIZES)


def cache_root() -> Path:
    """Where soybean keeps what it caches on disk (module docstring): captures here, route walks
    (``route_cache``) beside them."""
    return Path(os.environ.get("SOYBEAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "soybean"))


def cache_dir() -> Path:
    """Where captures are kept (module docstring)."""
    return cache_root() / "captures"


def enabled() -> bool:
    """False when ``SOYBEAN_NO_CACHE`` is set to anything but 0."""
    return os.environ.get("SOYBEAN_NO_CACHE", "0") in ("", "0")


def _versions() -> dict[str, str]:
    out = {"format": str(FORMAT), "torch": torch.__version__}
    for name in ("soybean", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def _source_digest(ref: str) -> str:
    """The bytes of the code a model reference names: a ``path/file.py:fn`` file, a ``pkg.module:fn`` module's
    file, or soybean's own package (``hf:`` and built-in references), so an edit to the model is a new key."""
    path: str | None = None
    if ":" in ref and not ref.startswith("hf:"):
        where = ref.rsplit(":", 1)[0]
        if where.endswith(".py"):
            path = where
        else:
            try:
                spec = importlib.util.find_spec(where)
                path = spec.origin if spec is not None else None
            except (ImportError, ValueError):
                path = None
    if path is not None and os.path.isfile(path):
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return code_digest()  # soybean's own factories: its source tree


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of every source file of the soybean package (names and bytes): an edit to soybean itself (how capture
    folds a mask, which ops a pass fuses) is a new key, although its version string stays."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def capture_key(ref: str, args: dict[str, Any], precision: str) -> str:
    """The cache key of capturing ``ref`` built with ``args`` under ``precision`` (module docstring)."""
    parts = {"ref": ref, "args": {k: repr(v) for k, v in sorted(args.items())}, "precision": precision,
             "source": _source_digest(ref), "code": code_digest(), **_versions()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# ---- the stored form ----

def _target(t: Any) -> tuple:
    if isinstance(t, torch._ops.OpOverload):
        return ("aten", t._schema.name, t._overloadname)
    if isinstance(t, str):  # call_module / get_attr / placeholder / output
        return ("str", t)
    return ("fn", t.__module__, t.__qualname__)


def _resolve(t: tuple) -> Any:
    kind = t[0]
    if kind == "str":
        return t[1]
    if kind == "aten":
        ns, name = t[1].split("::")
        packet = getattr(getattr(torch.ops, ns), name)
        return getattr(packet, t[2] or "default")
    obj: Any = importlib.import_module(t[1])
    for part in t[2].split("."):
        obj = getattr(obj, part)
    return obj


def _val(v: Any, storages: dict[int, list[int]]) -> Any:
    """A value's stored form; tensors that share a storage (a view and its base, which the memory model tells
    apart by storage: ``cost.memory``) keep one storage number, ``storages`` its size in bytes."""
    if isinstance(v, torch.Tensor):
        key = v.untyped_storage()._cdata
        sid = storages.setdefault(key, [len(storages), 0])
        sid[1] = max(sid[1], int(v.untyped_storage().nbytes()))
        return ("tensor", tuple(int(s) for s in v.shape), tuple(int(s) for s in v.stride()), v.dtype,
                bool(v.requires_grad), sid[0], int(v.storage_offset()), tensor_dynamic(v))
    if isinstance(v, (list, tuple)):
        return ("list" if isinstance(v, list) else "tuple", [_val(x, storages) for x in v])
    if v is None or isinstance(v, (int, float, bool)):
        return ("const", v)
    raise TypeError(f"cannot store {type(v).__name__} metadata")


def _unval(v: tuple, storages: dict[int, Any]) -> Any:
    if v[0] == "tensor":
        shape, stride, dtype, grad, sid, offset, dynamic = v[1:]
        t = torch.empty(0, dtype=dtype, device="meta").set_(storages[sid], offset, shape, stride)
        if dynamic:  # its data-dependent dims (``rules.datadep.concretize``)
            setattr(t, DYNAMIC, dynamic)
        return t.requires_grad_(True) if grad else t
    if v[0] in ("list", "tuple"):
        xs = [_unval(x, storages) for x in v[1]]
        return xs if v[0] == "list" else tuple(xs)
    return v[1]


def _arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return ("node", a.name)
    if isinstance(a, (list, tuple)):  # fx's immutable_list is a list
        return ("list" if isinstance(a, list) else "tuple", [_arg(x) for x in a])
    if isinstance(a, dict):
        return ("dict", {k: _arg(x) for k, x in a.items()})
    if isinstance(a, slice):
        return ("slice", (_arg(a.start), _arg(a.stop), _arg(a.step)))
    if isinstance(a, torch._ops.OpOverload) or callable(a) and not isinstance(a, type):
        return ("callable", _target(a))
    return ("value", a)


def _unarg(a: tuple, env: dict[str, fx.Node]) -> Any:
    kind, x = a
    if kind == "node":
        return env[x]
    if kind in ("list", "tuple"):
        xs = [_unarg(y, env) for y in x]
        return xs if kind == "list" else tuple(xs)
    if kind == "dict":
        return {k: _unarg(y, env) for k, y in x.items()}
    if kind == "slice":
        return slice(*(_unarg(y, env) for y in x))
    if kind == "callable":
        return _resolve(x)
    return x


def _stack(meta: Any) -> Any:
    """A module stack with its types as names (a class is stored by reference elsewhere; here only names count)."""
    if not isinstance(meta, dict):
        return meta
    return {k: (v[0], v[1] if isinstance(v[1], str) else f"{v[1].__module__}.{v[1].__qualname__}")
            for k, v in meta.items()}


def dumps(cap: Captured) -> bytes:
    """``cap`` in the stored form (module docstring)."""
    if any(n.op in ("get_attr", "call_module") for n in cap.graph.nodes):
        raise TypeError("a capture with module attributes is not stored")
    nodes = []
    storages: dict[int, list[int]] = {}
    for n in cap.graph.nodes:
        meta = {k: n.meta[k] for k in _META_KEYS if k in n.meta}
        if "nn_module_stack" in meta:
            meta["nn_module_stack"] = _stack(meta["nn_module_stack"])
        nodes.append({"name": n.name, "op": n.op, "target": _target(n.target), "args": _arg(n.args),
                      "kwargs": _arg(n.kwargs), "val": _val(n.meta["val"], storages) if "val" in n.meta else None,
                      "meta": meta})
    buf = io.BytesIO()
    torch.save(cap.constants, buf)
    state = {"format": FORMAT, "nodes": nodes, "constants": buf.getvalue(),
             "storages": [nbytes for _, nbytes in sorted(storages.values())],
             **{k: getattr(cap, k) for k in ("params", "buffers", "inputs", "aliases", "fingerprint", "precision",
                                             "out_spec", "in_spec", "frozen", "arg_names", "keys", "views",
                                             "functions", "grad_inputs")}}
    return pickle.dumps(state)


def loads(data: bytes) -> Captured:
    """The capture ``dumps`` stored."""
    with warnings.catch_warnings():  # torch's pytree warns about its own LeafSpec while unpickling a spec
        warnings.simplefilter("ignore", FutureWarning)
        state = pickle.loads(data)
    if state.get("format") != FORMAT:
        raise ValueError("another stored form")
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    storages = {i: torch.empty(n, dtype=torch.uint8, device="meta").untyped_storage()
                for i, n in enumerate(state["storages"])}
    for rec in state["nodes"]:
        target = _resolve(rec["target"])
        args, kwargs = _unarg(rec["args"], env), _unarg(rec["kwargs"], env)
        if rec["op"] == "placeholder":
            n = g.placeholder(target)
        elif rec["op"] == "output":
            n = g.output(args[0])
        else:
            n = g.create_node(rec["op"], target, args, kwargs, name=rec["name"])
        n.name = rec["name"]
        if rec["val"] is not None:
            n.meta["val"] = _unval(rec["val"], storages)
        n.meta.update(rec["meta"])
        env[rec["name"]] = n
    constants = torch.load(io.BytesIO(state["constants"]), weights_only=False)
    gm = fx.GraphModule(torch.nn.Module(), g)
    return Captured(gm, state["params"], state["buffers"], state["inputs"], state["aliases"], state["fingerprint"],
                    state["precision"], state["out_spec"], state["in_spec"], constants, state["frozen"],
                    state["arg_names"], state["keys"], state["views"], grad_inputs=state["grad_inputs"],
                    functions=state["functions"])


def load(key: str) -> Captured | None:
    """The capture stored under ``key``, or None (none, or one that cannot be read: it is dropped)."""
    path = cache_dir() / f"{key}.pt"
    if not path.is_file():
        return None
    try:
        return loads(path.read_bytes())
    except Exception:  # a file from another version, half written, or unreadable: capture afresh
        path.unlink(missing_ok=True)
        return None


def store(key: str, cap: Captured) -> Path | None:
    """Store ``cap`` under ``key`` (written aside, then renamed: a reader never sees half a file); None when the
    capture cannot be stored or the directory cannot be written (caching is an optimisation, never an error)."""
    try:
        data = dumps(cap)
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        path = d / f"{key}.pt"
        os.replace(tmp, path)
        return path
    except (OSError, TypeError, pickle.PicklingError, AttributeError):
        return None


__all__ = ["cache_dir", "capture_key", "dumps", "enabled", "load", "loads", "store"]
