"""The run's parts, built from the plan: the model (its weights, its float8 linears, its recompute policy), the
loss, the optimizer (with its loss scaler), the batches and the HellaSwag examples, the step that combines them,
and the loop's progress.

The parts that hold state are `Stateful` (state_dict / load_state_dict), and a checkpoint is
`{name: part.state_dict()}` over `Parts.stateful()`: adding a part with state adds it to the checkpoint by
construction. The others hold none: the recompute policy and the loss are functions, the batches a pure
function of (seed, step), the HellaSwag examples read once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch
import torch.nn as nn

from . import distributed, fp8, hf, recompute
from .config import Config, LossConfig
from .data import DeviceBatches, TokenData
from .distributed import Dist
from .evaluate import HellaSwagExample, load_hellaswag
from .model import GPT
from .model_config import SCRATCH
from .plan import Plan
from .precision import Precision
from .progress import Progress
from .step import Phase, TrainStep, record_function


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RandomState:
    """The process's random generators (Python, NumPy, torch CPU and CUDA) as a checkpoint part: dropout
    masks and anything else drawn after a resume continue the sequence of an unbroken run."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The generators take CPU tensors only."""
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"].cpu())
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])

    @staticmethod
    def combine_ranks(states: list[dict[str, Any]]) -> dict[str, Any]:
        """A job of another size continues rank 0's generators on every rank: each rank seeds them with
        trainer.seed alike."""
        return states[0]


@dataclass
class Parts:
    model: GPT
    loss_module: nn.Module  # forward(x, y) -> loss; DDP around it, or over the FSDP-sharded model
    optimizer: Any  # minitrain.optim's AdamW, Muon or TorchAdamW
    data: TokenData  # the tokenised corpus the batches read, and its tokenizer (the sample's, HellaSwag's)
    train_batches: DeviceBatches
    val_batches: DeviceBatches
    hellaswag: Optional[list[HellaSwagExample]]  # trainer.eval_hellaswag's examples, scored at each eval step
    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # compiled when the plan compiles
    eager_forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # what the compile check compares with
    train_step: TrainStep
    progress: Progress
    rng: RandomState
    init_weights: Optional[Path]  # the file model.init_from's weights came from

    def stateful(self) -> dict[str, Stateful]:
        """Everything a checkpoint restores."""
        return {"model": self.model, "optimizer": self.optimizer, "rng": self.rng, "progress": self.progress}

    def per_rank(self) -> dict[str, Callable[[list[dict[str, Any]]], dict[str, Any]]]:
        """The parts whose state differs by rank, stored per rank, each with how a rank of a job of another size
        makes its state from the saved ranks'."""
        return {"rng": RandomState.combine_ranks, "progress": Progress.combine_ranks}


def loss_from_config(loss: LossConfig, plan: Plan):
    """`loss_fn(hidden, weight, targets)` as the plan resolved loss.impl: the fused linear cross-entropy (logits
    never in HBM), with the loss group's workspace settings, or F.cross_entropy on full logits; the logits
    soft-capped as model.logit_softcap says."""
    from .ops import fused_linear_cross_entropy, linear_cross_entropy_reference

    softcap = plan.model.logit_softcap
    if plan.loss_impl == "torch":
        return lambda h, w, y: linear_cross_entropy_reference(h, w, y, softcap=softcap)
    chunk_bytes, low_memory = loss.chunk_bytes, loss.low_memory
    return lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk_bytes=chunk_bytes, low_memory=low_memory,
                                                      softcap=softcap)


def build_model(plan: Plan, cfg: Config, dist: Dist) -> tuple[GPT, Optional[Path]]:
    """The GPT on the plan's device, with model.init_from's weights (and the file they came from) before anything
    copies them, in the dtype it is stored in, the plan's float8 linears swapped in, its blocks run by the recompute
    policy."""
    with torch.device(plan.device):
        model = GPT(plan.model)
    weights = hf.load_weights(model) if cfg.model.init_from != SCRATCH else None
    model.to(dtype=plan.precision.stored_param_dtype(dist.sharded))
    fp8.convert(model.blocks, plan.float8_linears, plan.precision.float8, plan.precision.float8_kernels,
                plan.float8_all_gather)
    recompute.apply_policy(model, plan.checkpointing, compiled=plan.compiled)
    return model, weights


def forward_loss_of(loss_module: nn.Module, precision: Precision, device_type: str):
    """The model's forward and loss under the precision's autocast: what the step compiles."""

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with precision.autocast(device_type):
            return loss_module(x, y)

    return forward_loss


def build(plan: Plan, cfg: Config, data: TokenData, dist: Dist, phase: Phase = record_function) -> Parts:
    """Every part of the run, as the plan resolved them. `phase` wraps each phase of a step (a profiler label;
    benchmarks pass timers)."""
    from . import optim

    model, weights = build_model(plan, cfg, dist)
    loss_module = distributed.wrap(model, loss_from_config(cfg.loss, plan), plan.precision, cfg.distributed, dist)
    optimizer = optim.from_config(cfg.optimizer, plan, model, dist)
    t = cfg.trainer
    train_batches = DeviceBatches.from_config(t, plan, data, "train")
    val_batches = DeviceBatches.from_config(t, plan, data, "val")
    hellaswag = load_hellaswag(t.eval_hellaswag, t.eval_hellaswag_examples) if t.eval_hellaswag else None
    eager = forward_loss_of(loss_module, plan.precision, plan.device.type)
    compiled = torch.compile(eager, mode=plan.compile_mode) if plan.compiled else eager
    train_step = TrainStep(compiled, loss_module, optimizer, train_batches, plan.schedule, plan.grad_accum, dist,
                           plan.cuda_graphs, phase)
    return Parts(model, loss_module, optimizer, data, train_batches, val_batches, hellaswag, compiled, eager,
                 train_step, Progress(plan.device, dist), RandomState(), weights)
