"""The plain-PyTorch recipe, for comparison: torch.optim.AdamW (fused on CUDA, foreach on CPU),
clip_grad_norm_, and torch.amp.GradScaler for loss scaling. No master weights: params are updated in
their own dtype. The interface of minitrain.optim.AdamW, so a caller never knows which one is behind."""

from dataclasses import asdict

import torch

from minitrain.compat import grad_scaler_found_infs
from minitrain.loss_scale import LossScaling


class TorchAdamW:
    def __init__(self, param_groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 max_grad_norm=1.0, loss_scaling: LossScaling | None = None):
        groups = list(param_groups)
        self._params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
        self.device = self._params[0].device
        cuda = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay, fused=cuda, foreach=not cuda)
        self.param_groups = self.opt.param_groups
        self.max_grad_norm = max_grad_norm
        self.loss_scaler = torch.amp.GradScaler(self.device.type, **asdict(loss_scaling)) if loss_scaling else None
        self._grad_norm = torch.zeros((), device=self.device)
        self._skipped = torch.zeros((), dtype=torch.int32, device=self.device)

    def scale(self, loss):
        return loss if self.loss_scaler is None else self.loss_scaler.scale(loss)

    def set_lr(self, lr):
        for g in self.param_groups:
            g["lr"] = lr

    def step(self):
        scaler = self.loss_scaler
        if scaler is not None:
            scaler.unscale_(self.opt)
        # clip_grad_norm_ with max_norm=inf still returns the norm (and multiplies by 1)
        norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm or float("inf"))
        self._grad_norm.copy_(norm)
        if scaler is None:
            self.opt.step()
            return
        scaler.step(self.opt)  # fused AdamW consumes found_inf on the device
        for found_inf in grad_scaler_found_infs(scaler, self.opt):
            self._skipped.add_(found_inf.int())
        scaler.update()

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)

    def stats(self):
        """As AdamW's: loss_scale only with a loss scaler."""
        stats = {"grad_norm": self._grad_norm, "skipped_steps": self._skipped}
        if self.loss_scaler is not None:
            stats["loss_scale"] = torch.tensor(self.loss_scaler.get_scale())  # GradScaler's is a float
        return stats

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "skipped_steps": self._skipped,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, sd):
        if self.loss_scaler is not None and sd.get("loss_scaler") is None:
            raise ValueError("state_dict has no loss-scaler state, but this optimizer scales the loss "
                             "(it was saved by a run without loss scaling)")
        self.opt.load_state_dict(sd["opt"])
        self._skipped.copy_(sd["skipped_steps"])
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(sd["loss_scaler"])
