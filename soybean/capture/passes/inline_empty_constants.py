"""``inline_empty_constants``: an empty tensor constant (a KV cache's start) becomes ``aten.empty`` in the graph."""
from __future__ import annotations

import torch
from torch import fx

from .common import CONSTANTS


def inline_empty_constants(gm: fx.GraphModule) -> None:
    """An empty tensor constant (a KV cache starts from empty tensors it concatenates keys onto) holds no values:
    it is created in the graph instead (``aten.empty``, which every rank makes locally)."""
    constants: dict[str, torch.Tensor] = gm.meta.get(CONSTANTS, {})
    values = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in constants
              and not constants[n.name].numel()]
    if not values:
        return
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for n in values:
        c = constants.pop(n.name)
        with gm.graph.inserting_after(last):
            made = gm.graph.call_function(torch.ops.aten.empty.memory_format, (list(c.shape),),
                                          {"dtype": c.dtype, "device": c.device})
        made.meta.update(n.meta)
        n.replace_all_uses_with(made)
        gm.graph.erase_node(n)
