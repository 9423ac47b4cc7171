"""Batches of random windows of the training stream; the windows of a step depend only on (seed, step), so
resuming, changing grad_accum or adding ranks never changes which windows a step sees."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..config import TrainerConfig
from .corpus import DataError
from .shards import TokenData, TokenStream


class Batches:
    """Random windows of `block_size + 1` tokens; the windows of a step depend only on (seed, step).

    With `vocab_size`, every window is checked on the host to hold ids below it: the cache's checksum
    covers a large token file only in part, and an id out of range would otherwise fail as an embedding
    index error mid-run (a device-side assert on CUDA) or, below the model's padded vocabulary, not at all."""

    def __init__(self, tokens: TokenStream | np.ndarray, block_size: int, batch_size: int, seed: int,
                 device: torch.device, vocab_size: Optional[int] = None, cache_path: Optional[Path] = None):
        self.tokens = tokens if isinstance(tokens, TokenStream) else TokenStream([tokens])
        self.block_size, self.batch_size = block_size, batch_size
        self.seed, self.device, self.vocab_size, self.cache_path = seed, device, vocab_size, cache_path

    def starts(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch of `step`."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def host_windows(self, step: int, part: int = 0, n_parts: int = 1) -> torch.Tensor:
        """Windows (B/n_parts, T+1) of slice `part` of step `step`'s global batch, int64 on the host (whatever
        torch's default device: torch.set_default_device("cuda") must not move them); in pinned memory when the
        batches go to CUDA, so that the copy to the device is asynchronous (from pageable memory it would make the
        host wait)."""
        per = self.batch_size // n_parts
        starts = self.starts(step)[part * per:(part + 1) * per]
        win = torch.empty((len(starts), self.block_size + 1), dtype=torch.int64, device="cpu",
                          pin_memory=self.device.type == "cuda")
        ids = win.numpy()
        for row, start in zip(ids, starts):
            self.tokens.read(int(start), row)
        if self.vocab_size is not None and (largest := int(ids.max())) >= self.vocab_size:
            raise DataError(f"the batch of step {step} holds token id {largest}, outside the tokenizer's "
                            f"{self.vocab_size} ids: the token cache {self.cache_path} is corrupt (its checksums "
                            "cover large shards only in part); delete it to have it rebuilt")
        return win

    def get(self, step: int, part: int = 0, n_parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B/n_parts, T) of slice `part` of step `step`'s global batch."""
        win = self.host_windows(step, part, n_parts)
        if self.device.type == "cuda":
            win = win.to(self.device, non_blocking=True)
        return win[:, :-1], win[:, 1:]


class DeviceBatches(Batches):
    """`Batches` with the next request's windows prepared while the current step runs: on CUDA they are gathered
    into pinned memory and copied on a side stream, so the step's launches wait neither for the host's gather
    nor for a copy on the compute stream, and nothing makes the host wait for the device.

    The caller asks in a predictable order: for each step, the aligned run of `grad_accum` parts of its rank
    (part rank*grad_accum + 0 .. grad_accum-1 of n_parts), then the next step. A request that is not the
    predicted one (the first after a resume, an eval pass, another split) is built on the spot: the result is
    the same, so the batches stay a pure function of (seed, step). On the CPU the same order is kept, without
    a copy. The next request's gather runs inside `get`, before it returns: it overlaps the device's work
    whenever the host is ahead of the device, which it is at every step but the one after a log step's sync.

    Pinned buffers come from torch's caching host allocator, which hands a buffer out again only once the copy
    recorded on it has completed (an event query, never a wait): the ring of host buffers the prefetch needs,
    without the host synchronising with the device."""

    def __init__(self, tokens: TokenStream | np.ndarray, block_size: int, batch_size: int, seed: int,
                 device: torch.device, grad_accum: int = 1, vocab_size: Optional[int] = None, cache_path: Optional[Path] = None):
        super().__init__(tokens, block_size, batch_size, seed, device, vocab_size, cache_path)
        self.grad_accum = grad_accum
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next: Optional[tuple] = None  # (request, windows, copy-done event) of the predicted request

    @classmethod
    def from_config(cls, t: TrainerConfig, plan, data: TokenData, split: str) -> "DeviceBatches":
        """A run's batches of `split` as the plan (minitrain.plan.Plan) lays the step out, their ids checked against
        the tokenizer's: train, trainer.batch_size sequences a step in the plan's micro-batches; val, one micro-batch
        a rank per call, from windows seeded apart from the training ones."""
        T, checked = plan.model.block_size, dict(vocab_size=data.vocab_size, cache_path=data.path)
        if split == "train":
            return cls(data.train, T, t.batch_size, t.seed, plan.device, grad_accum=plan.grad_accum, **checked)
        if split == "val":
            return cls(data.val, T, plan.micro_batch * plan.world_size, t.seed + 1, plan.device, **checked)
        raise ValueError(f"split must be train or val, got {split!r}")

    def get(self, step: int, part: int = 0, n_parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        request = (step, part, n_parts)
        staged = self._next if self._next is not None and self._next[0] == request else self._stage(request)
        _, win, copied = staged
        if copied is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(copied)
            win.record_stream(consumer)  # its memory is not handed out again before the step has read it
        self._next = self._stage(self._following(request))
        return win[:, :-1], win[:, 1:]

    def _following(self, request: tuple[int, int, int]) -> tuple[int, int, int]:
        step, part, n_parts = request
        if (part + 1) % self.grad_accum:
            return step, part + 1, n_parts
        return step + 1, part + 1 - self.grad_accum, n_parts

    def _stage(self, request: tuple[int, int, int]) -> tuple:
        win = self.host_windows(*request)
        if self.copy_stream is None:
            return request, win, None
        with torch.cuda.stream(self.copy_stream):
            win = win.to(self.device, non_blocking=True)
        return request, win, self.copy_stream.record_event()
