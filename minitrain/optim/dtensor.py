"""FSDP2's parameters are DTensors: the optimizer works on their local shards and hands DTensors back."""

import sys

from torch.distributed.tensor import DTensor

from minitrain.compat import dtensor_local_tensor, float8_weight_tensor


def local(t):
    """This rank's shard of a DTensor (a view: writing it writes the parameter); a tensor itself. A float8
    all-gather weight (torchao's, precision=fp8 under fsdp) is a wrapper that changes only how FSDP gathers it:
    the plain tensor inside holds the shard, which the kernels that take pointers must see."""
    t = dtensor_local_tensor(t) if isinstance(t, DTensor) else t
    return float8_weight_tensor(t) if _is_float8_all_gather_weight(t) else t


def _is_float8_all_gather_weight(t) -> bool:
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")  # never imported: no such weight exists
    return fsdp_utils is not None and isinstance(t, fsdp_utils.WeightWithDynamicFloat8CastTensor)


def any_sharded(tensors) -> bool:
    return any(isinstance(t, DTensor) for t in tensors)


def like(p, t):
    """`t`, a tensor shaped like p's local shard, as a tensor shaped like p: a DTensor over `t` when
    p is one (a state_dict that torch.distributed.checkpoint can reshard)."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
