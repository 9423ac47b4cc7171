"""Optimizers: AdamW (loop / foreach / fused Triton), Muon with AdamW for the rest (the same three), and the
plain-PyTorch baseline, one interface: scale(loss), set_lr(lr), step(), zero_grad(), stats(), state_dict() /
load_state_dict() (the loss scaler's state included), param_groups, device."""

from .adamw import AdamW
from .build import build_adamw, from_config
from .muon import Muon, MuonHyper
from .optimizer import Numerics
from .torch_baseline import TorchAdamW

__all__ = ["AdamW", "Muon", "MuonHyper", "Numerics", "TorchAdamW", "build_adamw", "from_config"]
