"""trainer.deterministic: the process-wide switches under which two runs of one config compute the same bits.

On a GPU the default step is not reproducible bit for bit: some kernels add their partial sums in the order
the hardware happens to finish them, and some are picked by timing. With the switch on:

  attention's backward (flash, memory-efficient),    torch.use_deterministic_algorithms(True): each op with
  the embeddings' backward (index_put / scatter       such sums runs its ordered variant; one that has none
  with atomics, in eager and in Inductor's code)      raises instead of running (warn_only=False)
  Inductor's reductions                              the same call turns on Inductor's deterministic mode:
                                                     configs chosen by rule, not by timing them on the device
  cuDNN's attention (its dQ sums are unordered)      off: SDPA picks flash or memory-efficient attention
  cuDNN's algorithms                                 cudnn.deterministic, no benchmarking
  cuBLAS                                             one fixed workspace per handle and stream
                                                     (CUBLAS_WORKSPACE_CONFIG, before the first GEMM)

minitrain's own Triton kernels need nothing: the loss's softmax rows, the optimizer's norm and the decode
linears' split sums reduce in a fixed order, with atomics for counters only (tests/test_determinism.py checks);
Muon's Newton–Schulz kernels (optimizer.muon.ns_kernel=triton) take one config by rule, not by timing, under the
switch (minitrain/optim/newton_schulz_triton.py).
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"  # one 4 MiB workspace per handle and stream, as cuBLAS's reproducibility notes ask


def apply(deterministic: bool) -> None:
    """Set the switches for this process, both ways (one process may build several trainers). Call before the
    first GEMM: cuBLAS reads its workspace setting once. An explicit CUBLAS_WORKSPACE_CONFIG is kept."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.backends.cudnn.benchmark = False
    if deterministic or torch.are_deterministic_algorithms_enabled():  # each call imports Inductor's config (1 s)
        torch.use_deterministic_algorithms(deterministic, warn_only=False)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cuda.enable_cudnn_sdp(not deterministic)
