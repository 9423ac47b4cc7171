"""The parameters of one dtype and what the optimizer keeps for them: a layout, the state (and its share of the
state_dict), a gradient source."""

import torch

from minitrain.compat import foreach_copy_

from .dtensor import like, local
from .grads import GatheredGrads, InPlaceGrads, MainGrads
from .layout import Layout


def _masters(layout: Layout, params, has_master: bool):
    """fp32 masters for low-precision params, a flat buffer of the layout and a view per param, starting as the
    params' values (the params stay where the model put them); (None, None) without."""
    if not has_master:
        return None, None
    master = torch.zeros(layout.size, dtype=torch.float32, device=params[0].device)
    masters = layout.views(master)
    foreach_copy_(masters, [p.detach() for p in params])
    return master, masters


class AdamState:
    """m, v and, for low-precision params, fp32 masters: flat fp32 buffers of the layout, a view per param."""

    def __init__(self, layout: Layout, params, has_master: bool):
        device = params[0].device
        self.exp_avg = torch.zeros(layout.size, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(layout.size, dtype=torch.float32, device=device)
        self.exp_avgs, self.exp_avg_sqs = layout.views(self.exp_avg), layout.views(self.exp_avg_sq)
        self.master, self.masters = _masters(layout, params, has_master)

    def moments(self) -> dict:
        """The per-param views the state_dict holds besides the master, by their state_dict keys."""
        return {"exp_avg": self.exp_avgs, "exp_avg_sq": self.exp_avg_sqs}


class MuonState:
    """Muon's one momentum buffer (torch.optim.Muon's `momentum_buffer`) and, for low-precision params, fp32
    masters: flat fp32 buffers of the layout, a view per param. Half the state of AdamW's m and v."""

    def __init__(self, layout: Layout, params, has_master: bool):
        self.momentum = torch.zeros(layout.size, dtype=torch.float32, device=params[0].device)
        self.momentums = layout.views(self.momentum)
        self.master, self.masters = _masters(layout, params, has_master)

    def moments(self) -> dict:
        return {"momentum_buffer": self.momentums}


class Bucket:
    """`owners` are the optimizer's parameters of one dtype (DTensors under FSDP2), `params` the tensors the
    update writes (their local shards: the ZeRO-3 layout, each rank updates 1/N of the model), `groups`
    their param-group indices and `index` their positions in the optimizer's parameter list. `state`: the
    class of what the optimizer keeps per parameter (AdamState, MuonState)."""

    def __init__(self, owners, groups, index, impl: str, has_master: bool, grad_dtype: torch.dtype,
                 state=AdamState):
        self.owners, self.groups, self.index = list(owners), groups, index
        self.params = [local(p) for p in self.owners]
        self.layout = Layout(self.params)
        self.state = state(self.layout, self.params, has_master)
        device = self.params[0].device
        if grad_dtype != self.params[0].dtype:
            self.grads = MainGrads(self.owners, self.layout, grad_dtype, device)
        elif impl == "fused":
            self.grads = InPlaceGrads(self.owners, grad_dtype)
        else:
            self.grads = GatheredGrads(self.owners, self.layout, grad_dtype, device)

    def state_dict(self) -> dict:
        """Per parameter, keyed by its position in the optimizer: its moments and master, views of the flat
        buffers (torch.save stores each buffer once), DTensors over them when the params are sharded."""
        state = {}
        for j, (i, p) in enumerate(zip(self.index, self.owners)):
            state[i] = {name: like(p, views[j]) for name, views in self.state.moments().items()}
            if self.state.master is not None:
                state[i]["master"] = like(p, self.state.masters[j])
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """`state`: the optimizer's, keyed by position (state_dict's layout)."""
        for j, i in enumerate(self.index):
            saved = state[i]
            for name, views in self.state.moments().items():
                views[j].copy_(local(saved[name]))
            if self.state.master is not None and "master" in saved:
                self.state.masters[j].copy_(local(saved["master"]))
                self.params[j].copy_(self.state.masters[j])  # the compute copy is the master's cast


def buckets_by_dtype(param_groups, impl: str, master_weights, grad_dtype, state=AdamState, groups=None,
                     order=None) -> list[Bucket]:
    """One bucket per parameter dtype, in order of first appearance. master_weights: None or True gives
    low-precision params fp32 masters, False none; grad_dtype: None reads gradients in the params' dtype.
    `groups`: the indices of the param groups to take (None: all); a bucket's group indices and positions still
    count over every group. `order`: a sort key of (param, group index) that orders each bucket's params (Muon: by
    shape, so that the matrices of one shape sit side by side)."""
    by_dtype, i = {}, 0
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            if groups is None or gi in groups:
                by_dtype.setdefault(p.dtype, []).append((p, gi, i))
            i += 1
    if order is not None:
        by_dtype = {dtype: sorted(pg, key=lambda entry: order(entry[0], entry[1])) for dtype, pg in by_dtype.items()}
    return [Bucket([p for p, _, _ in pg], [gi for _, gi, _ in pg], [i for _, _, i in pg], impl,
                   has_master=dtype != torch.float32 and master_weights is not False,
                   grad_dtype=grad_dtype or dtype, state=state)
            for dtype, pg in by_dtype.items()]
