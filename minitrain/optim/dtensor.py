"""FSDP2's parameters are DTensors: the optimizer works on their local shards and hands DTensors back."""

from torch.distributed.tensor import DTensor


def local(t):
    """This rank's shard of a DTensor (a view: writing it writes the parameter); a tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def any_sharded(tensors) -> bool:
    return any(isinstance(t, DTensor) for t in tensors)


def like(p, t):
    """`t`, a tensor shaped like p's local shard, as a tensor shaped like p: a DTensor over `t` when
    p is one (a state_dict that torch.distributed.checkpoint can reshard)."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
