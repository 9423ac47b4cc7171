"""Dynamic loss scaling for fp16, with all state on the device.

The scale and growth tracker are 0-d device tensors, so the optimizer can back off or grow them inside its step
without reading them back to the host. The rule and its defaults are minitrain/loss_scale.py's; `update` runs it
with torch's own kernel (torch.amp.GradScaler's), and the fused optimizer's finalize kernel (optim/adamw_triton.py)
is its twin: tests/test_amp.py holds both to loss_scale.update_rule.
"""

from dataclasses import replace

import torch

from .compat import amp_update_scale_
from .loss_scale import LossScaling


class DynamicLossScaler:
    def __init__(self, rule: LossScaling = LossScaling(), device=None):
        self.rule = rule
        self._scale = torch.full((), float(rule.init_scale), dtype=torch.float32, device=device)
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
        r = self.rule
        amp_update_scale_(self._scale, self.growth_tracker, found_inf, r.growth_factor, r.backoff_factor,
                          r.growth_interval)

    def state_dict(self):
        r = self.rule
        return {"scale": self._scale.clone(), "growth_tracker": self.growth_tracker.clone(),
                "growth_factor": r.growth_factor, "backoff_factor": r.backoff_factor,
                "growth_interval": r.growth_interval}

    def load_state_dict(self, sd):
        self._scale.copy_(sd["scale"])
        self.growth_tracker.copy_(sd["growth_tracker"])
        self.rule = replace(self.rule, growth_factor=sd["growth_factor"], backoff_factor=sd["backoff_factor"],
                            growth_interval=sd["growth_interval"])
