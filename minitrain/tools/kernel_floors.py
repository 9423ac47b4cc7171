"""Each kernel class of a training step beside its floor: how far the step's kernels are from the device.

A profile says where a step's GPU time goes, not how much of it could go: a class far above its floor is the
next cost to attack, one at its floor is done however large it is. A class's floor for one step is
max(bytes / copy bandwidth, FLOPs / GEMM rate), both ceilings measured on the device itself (a large
device-to-device copy, a large bf16 matmul), so the floor is what this device does at best with that work.

What each class counts, per step (tokens = batch x seq_len; A: bytes of an activation element, the compute
dtype; R: of a residual-stream element, the params' dtype, fp32 under autocast). Each input is read once and
each output written once:

  GEMMs          FLOPs of every matmul of forward and backward, the LM head's included: the MFU's 6N per
                 token (GPT.flops_per_token at seq_len 0, its attention term being linear in it). Bytes are
                 not counted: a GEMM with n_embd as one of its dimensions does at least n_embd / 2 FLOPs per
                 byte of 16-bit operands it moves, so at GPT-2 widths its FLOPs bind (a narrow model's GEMM
                 floor is loose).
  attention      causal attention's FLOPs: the MFU's attention term halved (it counts the full T x T score and
                 value products, a causal kernel computes half), backward twice the forward; a flash
                 backward's recompute of the scores is the kernel's choice, not counted. Bytes: forward reads
                 q, k, v and writes the output; backward reads those four and the output's gradient and
                 writes the gradients of q, k, v (A each, n_embd per token per layer).
  cross-entropy  the fused loss's row kernel, or torch's log-softmax and NLL kernels: the logits read once and
                 their gradient written once (A each, vocab per token); the matmuls on either side are GEMMs.
  GELU           forward reads its input, writes its output; backward reads the output's gradient and the
                 input, writes the input's gradient (A each, MLP width per token per layer).
  LayerNorm      the 2L + 1 norms, each fused with the residual add before it (inductor's fusion; eager runs
                 the adds as kernels of their own, so no floor there): forward reads the residual and the
                 branch and writes their sum (R each) and the normalised output (A), the first norm reads
                 the embeddings' sum only; backward reads the output's gradient (A), the input and the
                 residual's gradient and writes the input's gradient (R each), the last norm (ln_f) with no
                 residual gradient to add. Per-row statistics and the weights' gradients are n_embd or
                 tokens times smaller, not counted.
  AdamW          parameters x the fused step's bytes per parameter (adamw_triton.fused_bytes_per_param: the
                 clipping norm's pass and the update's), whichever implementation runs.
  other          every kernel no class claims: measured, no floor.

A kernel can run under its floor (measured / floor below 1): one whose input its producer has just written
may find part of it in the L2 cache (the floors assume every byte comes from and goes to HBM), and a copy is
half reads, half writes, so a kernel that mostly reads may stream faster than the copy does.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Optional

import torch

from minitrain.model import GPT, attention_flops_per_token
from minitrain.optim.adamw_triton import fused_bytes_per_param
from minitrain.precision import Precision
from minitrain.tools import bench

GEMM_SIZE = 8192  # a square bf16 matmul large enough for cuBLAS's sustained rate

GEMM, ATTENTION, CROSS_ENTROPY = "GEMMs", "attention", "cross-entropy"
GELU_FORWARD, GELU_BACKWARD = "GELU forward", "GELU backward"
LAYER_NORM_FORWARD, LAYER_NORM_BACKWARD = "LayerNorm forward", "LayerNorm backward"
ADAMW, OTHER = "AdamW", "other"

# Lowercase name patterns, first match wins: attention before GEMMs (torch's flash and memory-efficient
# kernels carry "cutlass" in their names), each backward before its forward (whose pattern it also matches).
KERNEL_CLASSES = (
    (ATTENTION, ("*sdpa*", "*flash*", "*fmha*", "*attention_kernel*", "*attention_backward*",
                 "*compute_dot_do_o*", "*convert_dq_to_16bits*")),
    (GEMM, ("nvjet_*", "*gemm*", "*gemv*", "*cutlass*", "*cublas*")),
    (CROSS_ENTROPY, ("_cross_entropy_rows_kernel", "_logit_grad_block_kernel", "*log_softmax*", "*logsoftmax*",
                     "*nll_loss*")),
    (GELU_BACKWARD, ("*gelu_backward*", "*gelubackward*")),
    (GELU_FORWARD, ("*gelu*",)),
    (LAYER_NORM_BACKWARD, ("*layer_norm_backward*", "*layer_norm_grad*", "*gammabetabackward*")),
    (LAYER_NORM_FORWARD, ("*layer_norm*",)),
    (ADAMW, ("_adamw_kernel", "_sumsq_kernel", "_finalize_kernel", "*multi_tensor_apply_kernel*",
             "*lpnorm_cleanup*")),
)
OTHER_NAMED = 5  # the "other" row names its largest kernels
NAME_CHARS = 90  # as much of a kernel's name as a profile's lists keep (bench_step.py's top kernels too)


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # bytes read + bytes written
    gemm_flops_per_s: float


@dataclass(frozen=True)
class Work:
    """What a kernel class must do in one step, at the least."""

    bytes: float = 0.0
    flops: float = 0.0

    def seconds(self, ceilings: Ceilings) -> float:
        return max(self.bytes / ceilings.copy_bytes_per_s, self.flops / ceilings.gemm_flops_per_s)


def _gemm_flops_per_s(device: torch.device) -> float:
    a, b = (torch.randn(GEMM_SIZE, GEMM_SIZE, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    return 2 * GEMM_SIZE**3 / (bench.kernel_ms(lambda: torch.mm(a, b, out=out)) / 1e3)


@functools.cache
def measure_ceilings(device: torch.device) -> Ceilings:
    """The device's copy bandwidth and bf16 GEMM rate. Measured once per process and device, so every row of
    a run is set against the same ceilings."""
    with torch.cuda.device(device):
        return Ceilings(copy_bytes_per_s=bench.copy_bytes_per_s(device), gemm_flops_per_s=_gemm_flops_per_s(device))


def classify(kernel: str) -> str:
    """The class whose patterns first match the kernel's name, else OTHER."""
    name = kernel.lower()
    return next((cls for cls, patterns in KERNEL_CLASSES if any(fnmatchcase(name, p) for p in patterns)), OTHER)


def causal_attention_flops(tokens: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """Forward + backward FLOPs of causal attention over `tokens`: the MFU's count halved, since a causal
    kernel computes half the T x T score and value products."""
    return tokens * attention_flops_per_token(n_layer, n_embd, seq_len) / 2


def step_work(model: GPT, precision: Precision, batch: int, seq_len: int,
              compiled: bool) -> dict[str, Optional[Work]]:
    """Each class's work in one optimizer step of `batch` sequences of `seq_len` tokens (the module docstring
    says what is counted); None where no floor model applies. `compiled`: inductor fuses each LayerNorm with
    its residual add."""
    cfg = model.cfg
    tokens = batch * seq_len
    act, resid = precision.compute_dtype.itemsize, precision.param_dtype.itemsize
    matmul_flops = model.flops_per_token(0)
    # forward reads q, k, v, writes out; backward reads q, k, v, out, grad_out, writes grad_q, grad_k, grad_v
    attention_tensors = 4 + 8
    norm_elements = tokens * cfg.n_embd
    fused_norms = 2 * cfg.n_layer  # all but the first, which follows the embeddings
    gelu_elements = tokens * model.blocks[0].mlp.c_fc.out_features * cfg.n_layer
    adamw_bytes = model.num_params(exclude_positions=False) * fused_bytes_per_param(
        precision.param_dtype, precision.grad_dtype, precision.master_weights)
    return {
        GEMM: Work(flops=tokens * matmul_flops),
        ATTENTION: Work(bytes=attention_tensors * tokens * cfg.n_embd * act * cfg.n_layer,
                        flops=causal_attention_flops(tokens, cfg.n_layer, cfg.n_embd, seq_len)),
        CROSS_ENTROPY: Work(bytes=2 * tokens * cfg.vocab_size * act),
        GELU_FORWARD: Work(bytes=2 * gelu_elements * act),
        GELU_BACKWARD: Work(bytes=3 * gelu_elements * act),
        LAYER_NORM_FORWARD: Work(bytes=norm_elements * ((resid + act) + fused_norms * (2 * resid + 2 * act)))
        if compiled else None,
        LAYER_NORM_BACKWARD: Work(bytes=norm_elements * (fused_norms * (3 * resid + act) + (2 * resid + act)))
        if compiled else None,
        ADAMW: Work(bytes=adamw_bytes),
    }


def floors_ms(work: Mapping[str, Optional[Work]], ceilings: Ceilings) -> dict[str, Optional[float]]:
    return {cls: None if w is None else w.seconds(ceilings) * 1e3 for cls, w in work.items()}


def _row(cls: str, kernels: list[tuple[str, float, float]], floor: Optional[float]) -> dict:
    ms = sum(k[1] for k in kernels)
    return {"class": cls, "kernels": len(kernels), "calls_per_step": sum(k[2] for k in kernels), "ms_per_step": ms,
            "floor_ms_per_step": floor, "ratio": ms / floor if floor else None,
            "gap_ms": None if floor is None else ms - floor}


def floor_table(kernels: Iterable[tuple[str, float, float]], floors: Mapping[str, Optional[float]]) -> list[dict]:
    """One row per class from the profile's (name, ms per step, calls per step) of every GPU kernel: measured
    beside the floor (ms per step), their ratio and gap. Largest gap first, then the classes without a floor
    by time, then OTHER, which names its largest kernels."""
    members = defaultdict(list)
    for kernel in kernels:
        members[classify(kernel[0])].append(kernel)
    rows = [_row(cls, members[cls], floors.get(cls)) for cls in dict.fromkeys([*floors, *members]) if cls != OTHER]
    with_floor = sorted((r for r in rows if r["gap_ms"] is not None), key=lambda r: -r["gap_ms"])
    without = sorted((r for r in rows if r["gap_ms"] is None), key=lambda r: -r["ms_per_step"])
    other = _row(OTHER, members[OTHER], None)
    other["largest"] = [{"kernel": name[:NAME_CHARS], "ms_per_step": ms}
                        for name, ms, _ in sorted(members[OTHER], key=lambda k: -k[1])[:OTHER_NAMED]]
    return [*with_floor, *without, other]


FLOOR_COLUMNS = (bench.Column("class", "class"), bench.Column("kernels", "kernels", "d"),
                 bench.Column("calls", "calls_per_step", ".1f"), bench.Column("measured", "ms_per_step", ".3f"),
                 bench.Column("floor", "floor_ms_per_step", ".3f"), bench.Column("x floor", "ratio", ".2f"),
                 bench.Column("gap", "gap_ms", ".3f"))


def format_table(floors: dict) -> list[str]:
    """The lines printed under a profile: the ceilings in the header, then each row of `floor_table`."""
    def largest(row: dict) -> str:
        return "largest: " + ", ".join(f"{k['kernel'][:40]} {k['ms_per_step']:.3f}" for k in row.get("largest", []))

    return [f"floors at copy {floors['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM "
            f"{floors['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s (both measured here); ms/step, largest gap first",
            *bench.table(floors["rows"], FLOOR_COLUMNS, note=lambda r: largest(r) if r.get("largest") else "")]
