"""Running the user's model eagerly while capturing or planning it, leaving it as it was."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def untouched(model: torch.nn.Module) -> Iterator[None]:
    """The block may run ``model`` (dynamo collecting its pieces, ``soybean.run.pieces``; a custom Function's
    backward checked, ``functions.own_backwards``): its buffers (batch norm's running statistics) and the random
    state are as before afterwards, so planning changes nothing a training run sees."""
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in saved:
                    b.copy_(saved[k])
