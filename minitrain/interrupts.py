"""Ctrl-C and SIGTERM during training: the first asks for a checkpoint after the current step, a second aborts."""

from __future__ import annotations

import signal
import threading
import time

import torch

from . import distributed
from .distributed import Dist


class TrainingInterrupted(Exception):
    """Ctrl-C or SIGTERM: a checkpoint was saved; the message says where. `main`: raised on the rank that
    reports it (under torchrun every rank stops, one says so); `exit_code`: 128 + the signal's number."""

    def __init__(self, message: str, main: bool = True, exit_code: int = 128 + signal.SIGINT):
        super().__init__(message)
        self.main, self.exit_code = main, exit_code


class Interrupts:
    """SIGINT (Ctrl-C) or SIGTERM (a scheduler's or `kill`'s stop, which torchrun forwards) while it is entered:
    the first asks for a checkpoint, a second one (a moment later) aborts at once. A terminal's Ctrl-C under
    torchrun reaches every worker twice, from the terminal and forwarded by torchrun: copies within
    SAME_INTERRUPT_S of the first are that one interrupt."""

    SAME_INTERRUPT_S = 1.0
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, say, dist: Dist, device: torch.device):
        self.say, self.dist, self.device = say, dist, device
        self.requested, self.first, self.signum, self.previous = False, 0.0, signal.SIGINT, {}
        self.when = "at the next log step (all ranks stop together)" if dist.enabled else "after this step"

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            if time.monotonic() - self.first < self.SAME_INTERRUPT_S:
                return
            raise KeyboardInterrupt
        self.requested, self.first, self.signum = True, time.monotonic(), signum
        what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        self.say(f"{what}: saving a checkpoint {self.when} (Ctrl-C again to abort without one)")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def agreed(self, logging: bool) -> bool:
        """Whether to stop now. One process stops at once; under torchrun every rank must stop at the same step,
        so the ranks agree at log steps (where they synchronise anyway)."""
        if not self.dist.enabled:
            return self.requested
        if not logging:
            return False
        flag = torch.tensor(float(self.requested), device=self.device)
        return bool(distributed.mean(flag, self.dist).item())

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
