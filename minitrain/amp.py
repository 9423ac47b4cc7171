"""Dynamic loss scaling for fp16, with all state on the device: the one home of the loss-scale rule.

The scale and growth tracker are 0-d device tensors, so the optimizer can back off or grow them inside
its step without reading them back to the host. The rule is `DynamicLossScaler.update`, i.e.
`torch._amp_update_scale_`, exactly `torch.amp.GradScaler.update`; the fused optimizer's finalize kernel
(optim/adamw_triton.py) is its twin, tested against it.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossScaling:
    """The rule's parameters, as torch.amp.GradScaler names them: an optimizer given these owns its scaler."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


class DynamicLossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, device=None):
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def to(self, device):
        """Move the state once (the only synchronising moment: the first step)."""
        if self._scale.device != torch.device(device):
            self._scale = self._scale.to(device)
            self.growth_tracker = self.growth_tracker.to(device)
        return self

    def scale(self, loss):
        return loss * self.to(loss.device)._scale

    def get_scale(self):
        return self._scale

    def update(self, found_inf):
        """found_inf: 0-d float device tensor (1.0 = this step's grads overflowed). Back off on an overflow;
        grow after growth_interval steps in a row without one (unless the grown scale is not finite)."""
        torch._amp_update_scale_(self._scale, self.growth_tracker, found_inf,
                                 self.growth_factor, self.backoff_factor, self.growth_interval)

    def state_dict(self):
        return {"scale": self._scale.clone(), "growth_tracker": self.growth_tracker.clone(),
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, sd):
        self._scale.copy_(sd["scale"])
        self.growth_tracker.copy_(sd["growth_tracker"])
        self.growth_factor = sd["growth_factor"]
        self.backoff_factor = sd["backoff_factor"]
        self.growth_interval = sd["growth_interval"]
