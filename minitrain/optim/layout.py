"""Where each parameter sits in its bucket's flat buffers: the constants the host code and the kernels share.

Every buffer the optimizer owns (fp32 masters, m, v, gathered gradients) is flat, one per parameter dtype,
with each parameter a view at an offset padded to ALIGN elements: a view then starts on a 256 B boundary of
an fp32 buffer, so kernels load it in whole vectors. The memory model pads by the same rule (`padded`).
"""

import torch

ALIGN = 64  # elements


def padded(numel: int) -> int:
    """`numel` rounded up to a whole number of ALIGN elements: what one tensor takes in a flat buffer."""
    return -(-numel // ALIGN) * ALIGN


class Layout:
    """The offsets of a list of tensors in one flat buffer, and their views into any buffer of that layout."""

    def __init__(self, tensors):
        self.offsets, n = [], 0
        for t in tensors:
            self.offsets.append(n)
            n += padded(t.numel())
        self.size = n
        self._specs = [(t.shape, torch.empty(t.shape, device="meta").stride(), o)
                       for t, o in zip(tensors, self.offsets)]

    def views(self, flat):
        """One view per tensor, shaped like it (contiguous) at its offset: made for every step's new
        grad buffer, so one as_strided call each (half the host time of slice + view)."""
        return [flat.as_strided(shape, strides, o) for shape, strides, o in self._specs]
