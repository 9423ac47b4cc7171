"""Several processes, one run: torchrun's environment -> a process group -> DDP or FSDP2 around the model.

Everything here is PyTorch's own engine (torch.distributed, DistributedDataParallel, FSDP2's
`fully_shard`); this module only decides how minitrain's parts plug into it:

  ddp   every rank holds the whole model and optimizer; DDP all-reduces gradients in buckets while
        backward still runs, and the fused AdamW (fp32 masters included) runs replicated.
  fsdp  ZeRO-3: each rank holds 1/N of every parameter, gradient and Adam moment. The sharded
        parameters are fp32 and ARE the master weights; FSDP2's mixed-precision policy all-gathers
        them as the precision's param_dtype for compute and reduce-scatters gradients in fp32. So a
        precision that asks for bf16/fp16 params with fp32 masters (`bf16`, `fp16`) maps to fp32
        shards + bf16/fp16 compute, and AdamW sees fp32 params and keeps no separate master.
        Without masters (`bf16_no_master`) the shards stay in the param dtype. Blocks are sharded
        `distributed.fsdp_unit_blocks` at a time: FSDP2's hooks are Python that runs per unit, and
        with a unit per block the host, not the link, set the step time.

A rank that dies must not leave the others waiting forever: collectives time out after
`distributed.timeout_s` and raise, and torchrun stops the remaining workers when one exits non-zero.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import Config, DistributedConfig, DistributedMode
from .errors import ConfigError
from .precision import Precision


@dataclass(frozen=True)
class Dist:
    """Where this process sits in the job; mode=none is the single-process run (rank 0 of 1)."""

    mode: DistributedMode = DistributedMode.none
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.mode != DistributedMode.none

    @property
    def sharded(self) -> bool:
        return self.mode == DistributedMode.fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(cfg: Config, device: torch.device) -> tuple[Dist, torch.device]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
    returns this rank's place and its device (cuda:LOCAL_RANK on GPUs). Reuses a group already
    initialised, so one process can run several trainers."""
    mode, launched = cfg.distributed.mode, int(os.environ.get("WORLD_SIZE", "1"))
    if mode == DistributedMode.none:
        if launched > 1:
            raise ConfigError(f"distributed.mode: {launched} processes were launched (torchrun) but "
                              f"distributed=none would train {launched} copies into one run dir; "
                              "pass distributed=ddp or distributed=fsdp")
        return Dist(), device
    if "RANK" not in os.environ:
        raise ConfigError(f"distributed.mode={mode.value} needs torchrun's environment: "
                          f"torchrun --standalone --nproc_per_node=N scripts/train.py distributed={mode.value}")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=cfg.distributed.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return Dist(mode, rank, dist.get_world_size(), local_rank), device


def teardown(finished: bool = False) -> None:
    """Leave the process group. `finished`: this rank ended normally, as every rank does then; a barrier
    first, so no rank closes its connections while a peer still completes the last collective (gloo
    aborts that peer's process). A failing rank leaves at once, so its peers fail instead of waiting.
    Then collect: a collective's work objects can sit in reference cycles (checkpoint saves and loads
    leave some), and gloo aborting the process when the interpreter frees them at exit would turn a
    finished run into a failed rank."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def main_first(d: Dist):
    """Rank 0 runs the block first (e.g. builds the data cache), the others after it, from its result."""
    if d.enabled and not d.is_main:
        dist.barrier()
    yield
    if d.enabled and d.is_main:
        dist.barrier()


class LossModule(nn.Module):
    """forward(x, y) = hidden states + loss over the tied head. DDP and FSDP act in `forward` hooks,
    so the whole of the trainer's computation (the head inside the fused loss included) has to be
    one module's forward for them to see it."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = self.model.forward_hidden(x)
        return self.loss_fn(hidden.flatten(0, 1), self.model.lm_head_weight, y.flatten())


def wrap(model: nn.Module, loss_fn, precision: Precision, cfg: DistributedConfig, d: Dist) -> nn.Module:
    """The module the training step calls with (x, y): the plain loss module, DDP around it, or the
    loss module over an FSDP2-sharded model: `fsdp_unit_blocks` consecutive blocks per unit, the root
    holding embeddings, final norm and the tied head; `forward_hidden` registered as a forward so the
    root all-gathers."""
    loss_module = LossModule(model, loss_fn)
    if d.mode == DistributedMode.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [d.local_rank] if next(model.parameters()).is_cuda else None
        return DDP(loss_module, device_ids=device_ids)  # the model holds no buffers: nothing to broadcast
    if d.mode == DistributedMode.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        compute = precision.param_dtype if precision.master_weights else None
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        blocks, k = list(model.blocks), cfg.fsdp_unit_blocks
        for start in range(0, len(blocks), k):
            fully_shard(blocks[start:start + k], mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mp_policy=policy)
        register_fsdp_forward_method(model, "forward_hidden")
    return loss_module


def grad_sync(module: nn.Module, sync: bool):
    """DDP: skip the all-reduce on all but the last micro-batch (grads accumulate locally first).
    FSDP reduce-scatters every micro-batch: accumulating unsharded grads would undo the sharding."""
    if sync or not hasattr(module, "no_sync"):
        return contextlib.nullcontext()
    return module.no_sync()


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """In place, on the device, no host sync. For the optimizer's sum of squared grads: the sum is the
    global one, and an inf/NaN on any rank makes it non-finite on every rank (all skip together)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def mean(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """The mean over ranks of a device tensor (each rank's mean over equal-sized slices: the global mean)."""
    if not d.enabled:
        return t
    t = t.detach().float().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / d.world_size


def gather(obj: Any, d: Dist) -> list[Any]:
    """Every rank's `obj`, in rank order (host objects, e.g. memory counters, at log steps only)."""
    if not d.enabled:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out
