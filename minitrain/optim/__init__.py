"""Optimizers: AdamW (loop / foreach / fused Triton), Muon with AdamW for the rest (the same three), and the
plain-PyTorch baseline, one interface: scale(loss), set_lr(lr), step(), zero_grad(), stats(), state_dict() /
load_state_dict() (the loss scaler's state included), param_groups, device."""

from .adamw import AdamW
from .build import build_adamw, build_muon
from .muon import Muon
from .torch_baseline import TorchAdamW

__all__ = ["AdamW", "Muon", "TorchAdamW", "build_adamw", "build_muon"]
