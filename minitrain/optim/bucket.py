"""The parameters of one dtype and what the optimizer keeps for them: a layout, the state, a gradient source."""

import torch

from .dtensor import local
from .grads import GatheredGrads, InPlaceGrads, MainGrads
from .layout import Layout


class AdamState:
    """m, v and, for low-precision params, fp32 masters: flat fp32 buffers of the layout, a view per param.
    The masters start as the params' values; the params stay where the model put them."""

    def __init__(self, layout: Layout, params, has_master: bool):
        device = params[0].device
        self.exp_avg = torch.zeros(layout.size, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(layout.size, dtype=torch.float32, device=device)
        self.exp_avgs, self.exp_avg_sqs = layout.views(self.exp_avg), layout.views(self.exp_avg_sq)
        self.master = self.masters = None
        if has_master:
            self.master = torch.zeros(layout.size, dtype=torch.float32, device=device)
            self.masters = layout.views(self.master)
            torch._foreach_copy_(self.masters, [p.detach() for p in params])


class Bucket:
    """`owners` are the optimizer's parameters of one dtype (DTensors under FSDP2), `params` the tensors the
    update writes (their local shards: the ZeRO-3 layout, each rank updates 1/N of the model), `groups`
    their param-group indices and `index` their positions in the optimizer's parameter list."""

    def __init__(self, owners, groups, index, impl: str, has_master: bool, grad_dtype: torch.dtype):
        self.owners, self.groups, self.index = list(owners), groups, index
        self.params = [local(p) for p in self.owners]
        self.layout = Layout(self.params)
        self.state = AdamState(self.layout, self.params, has_master)
        device = self.params[0].device
        if grad_dtype != self.params[0].dtype:
            self.grads = MainGrads(self.owners, self.layout, grad_dtype, device)
        elif impl == "fused":
            self.grads = InPlaceGrads(self.owners, grad_dtype)
        else:
            self.grads = GatheredGrads(self.owners, self.layout, grad_dtype, device)
