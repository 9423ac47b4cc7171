"""How long an AdamW step takes, from three numbers: per-launch overhead, per-tensor host work, bandwidth.

The optimizer does ~1 FLOP per byte, so its time is whichever is larger: the host's work to issue it
(launches x overhead, plus what it does per parameter tensor; the GPU idles meanwhile) or moving its
bytes (bytes / bandwidth). The three implementations of minitrain.optim.AdamW sit at different points:

  per-tensor  ~15 torch ops per parameter tensor, each a separate pass over memory
  foreach     the same ~15 ops over tensor lists: a launch per op per list chunk, still 15 passes
  fused       a norm pass + a finalize + one update pass: 3 launches, the minimum bytes; but the host
              still reads every p.grad and its address each step, a term per tensor

The memory floor is what AdamW with fp32 state keeps per parameter: weights + grads + m + v
(+ fp32 masters for low-precision weights): 16 B/param for fp32 or bf16 + masters, 18 with fp32 grads.

Muon (optimizer=muon) costs its matrices FLOPs where AdamW costs bytes: Newton–Schulz's GEMMs, 5·(4·m + 2·m²/n)
FLOPs a parameter of an m x n matrix (m <= n), thousands where AdamW's update is ~15, at the GEMM rate; its
memory passes move about what AdamW's do (`muon_costs`), and it keeps one fp32 buffer a parameter instead of two.
matplotlib is imported by `plot` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minitrain.optim import newton_schulz
from minitrain.optim.adamw_triton import fused_bytes_per_param
from minitrain.optim.muon_triton import fused_bytes_per_param as muon_bytes_per_param

OPS_PER_STEP = 15  # torch ops of one unfused AdamW update with clipping and unscaling (optim/adamw_torch.py)
FOREACH_TENSORS_PER_LAUNCH = 48  # tensors one CUDA foreach kernel covers (multi_tensor_apply chunking)
FUSED_LAUNCHES = 3
# Bytes per parameter per step, bf16 params + fp32 masters. Unfused: each of the ~15 ops reads and writes
# its fp32 operands (counted op by op from optim/adamw_torch.py's _adamw_ and unscaling).
BYTES_PER_PARAM = {"fused": fused_bytes_per_param(torch.bfloat16, torch.bfloat16, master_weights=True),
                   "foreach": 130, "per-tensor": 130}
IMPLS = tuple(BYTES_PER_PARAM)
DEFAULT_LAUNCH_S = 5e-6  # eager PyTorch op dispatch + launch, measured on the H200 host
# Host time per parameter tensor of a fused step (its p.grad and address read, compared, and the work
# around them), measured on the H200 host: docs/benchmarks.md, "Fused AdamW". For the unfused paths the
# per-tensor host work is inside their per-launch overhead.
FUSED_HOST_S_PER_TENSOR = 0.3e-6
DEFAULT_BANDWIDTH = 4.0e12  # B/s: device-to-device copy on the H200 (4.8 TB/s nominal)


@dataclass
class Prediction:
    impl: str
    n_tensors: int
    launches: int
    host_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.host_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "host" if self.host_s >= self.memory_s else "bandwidth"


def launches(impl: str, n_tensors: int) -> int:
    if impl == "fused":
        return FUSED_LAUNCHES
    if impl == "foreach":
        return OPS_PER_STEP * math.ceil(n_tensors / FOREACH_TENSORS_PER_LAUNCH)
    return OPS_PER_STEP * n_tensors


def predict_step(impl: str, n_params: int, n_tensors: int, launch_s: float = DEFAULT_LAUNCH_S,
                 bandwidth: float = DEFAULT_BANDWIDTH, host_s_per_tensor: float = FUSED_HOST_S_PER_TENSOR) -> Prediction:
    """host_s_per_tensor: the fused step's per-tensor host term."""
    n = launches(impl, n_tensors)
    host = n * launch_s + (n_tensors * host_s_per_tensor if impl == "fused" else 0.0)
    return Prediction(impl, n_tensors, n, host, n_params * BYTES_PER_PARAM[impl] / bandwidth)


def memory_floor(n_params: int, master_weights: bool = True, fp32_grads: bool = False) -> int:
    """Bytes AdamW keeps for the whole run: 16 B/param (fp32, or 16-bit weights + fp32 masters), 18 with
    fp32 main grads next to 16-bit weights."""
    weights = 2 if master_weights else 4
    grads = 4 if fp32_grads or not master_weights else 2
    return n_params * (weights + grads + (4 if master_weights else 0) + 8)


def table(n_params: int, n_tensors: int, launch_s: float = DEFAULT_LAUNCH_S,
          bandwidth: float = DEFAULT_BANDWIDTH, host_s_per_tensor: float = FUSED_HOST_S_PER_TENSOR) -> str:
    lines = [f"AdamW step, {n_params / 1e6:.1f}M params in {n_tensors} tensors, {launch_s * 1e6:.1f} us/launch, "
             f"fused {host_s_per_tensor * 1e6:.2f} us/tensor of host work, {bandwidth / 1e12:.2f} TB/s",
             f"{'impl':<11} {'launches':>9} {'host ms':>10} {'memory ms':>10} {'step ms':>9}  bound"]
    for impl in IMPLS:
        p = predict_step(impl, n_params, n_tensors, launch_s, bandwidth, host_s_per_tensor)
        lines.append(f"{impl:<11} {p.launches:>9} {p.host_s * 1e3:>10.3f} {p.memory_s * 1e3:>10.3f} "
                     f"{p.seconds * 1e3:>9.3f}  {p.bound}")
    lines.append(f"memory floor: {memory_floor(n_params) / 1e9:.2f} GB (16 B/param), "
                 f"{memory_floor(n_params, fp32_grads=True) / 1e9:.2f} GB with fp32 grads (18 B/param)")
    return "\n".join(lines)


# What cuBLAS reaches on a large bf16 GEMM, assumed for a prediction: about 70% of an H100's or H200's dense bf16
# peak (989 TFLOP/s); scripts/bench_optimizer.py's Muon cases measure it (`bf16_gemm_tflops`).
DEFAULT_GEMM_FLOPS = 700e12
ADAMW_FLOPS_PER_PARAM = 15  # the fused update's arithmetic: the moments, the sqrt, the division, the decay


@dataclass
class Costs:
    """Per parameter and step (bf16 params + fp32 masters, bf16 grads), and the state kept per parameter."""

    name: str
    flops: float
    hbm_bytes: float  # the memory passes (Muon's GEMMs' own traffic is in their time)
    state_bytes: float  # weights + grads + masters + optimizer state

    def step_s(self, n_params: int, gemm_flops: float = DEFAULT_GEMM_FLOPS,
               bandwidth: float = DEFAULT_BANDWIDTH) -> float:
        """The floor: the GEMM FLOPs at the GEMM rate (Muon's only), the bytes at the copy bandwidth."""
        gemm = self.flops * n_params / gemm_flops if self.name.startswith("Muon") else 0.0
        return gemm + self.hbm_bytes * n_params / bandwidth


def muon_costs(shapes: list[tuple[int, int]], steps: int = newton_schulz.NS_STEPS) -> Costs:
    """Muon over the matrices of `shapes`, per parameter of them."""
    n = sum(rows * cols for rows, cols in shapes)
    flops = sum(newton_schulz.flops(shape, steps) for shape in shapes)
    return Costs("Muon", flops / n, muon_bytes_per_param(torch.bfloat16, torch.bfloat16, True), 2 + 2 + 4 + 4)


def adamw_costs() -> Costs:
    return Costs("AdamW", ADAMW_FLOPS_PER_PARAM, BYTES_PER_PARAM["fused"], memory_floor(1))


def cost_table(shapes: list[tuple[int, int]], gemm_flops: float = DEFAULT_GEMM_FLOPS,
               bandwidth: float = DEFAULT_BANDWIDTH, ns_steps: int = newton_schulz.NS_STEPS) -> str:
    """AdamW's and Muon's costs per parameter of the matrices `shapes` (a model's hidden matrices), Muon at
    `ns_steps` Newton-Schulz steps, and each one's step over them at `gemm_flops` and `bandwidth`."""
    n = sum(rows * cols for rows, cols in shapes)
    lines = [f"per parameter and step, {len(shapes)} matrices ({n / 1e6:.1f}M params), bf16 + fp32 masters; "
             f"Muon at {ns_steps} Newton-Schulz steps; GEMMs at {gemm_flops / 1e12:.0f} TFLOP/s, "
             f"{bandwidth / 1e12:.2f} TB/s",
             f"{'optimizer':<10} {'FLOPs':>9} {'HBM bytes':>10} {'state B':>8} {'step ms':>9}"]
    for c in (adamw_costs(), muon_costs(shapes, ns_steps)):
        lines.append(f"{c.name:<10} {c.flops:>9,.0f} {c.hbm_bytes:>10.0f} {c.state_bytes:>8.0f} "
                     f"{c.step_s(n, gemm_flops, bandwidth) * 1e3:>9.3f}")
    return "\n".join(lines)


def measured_points(bench: dict) -> dict[str, list[tuple[int, float]]]:
    """(n_tensors, ms) per impl from scripts/bench_optimizer.py's JSON (its loop row is per-tensor)."""
    names = {"loop": "per-tensor", "foreach": "foreach", "fused (ours)": "fused"}
    points: dict[str, list[tuple[int, float]]] = {}
    for case in bench["cases"].values():
        for row in case["rows"]:
            if row["row"] in names:
                points.setdefault(names[row["row"]], []).append((case["tensors"], row["ms"]))
    return points


def plot(n_params: int, path, launch_s: float = DEFAULT_LAUNCH_S, bandwidth: float = DEFAULT_BANDWIDTH,
         measured: dict[str, list[tuple[int, float]]] | None = None, mark_tensors: int | None = None,
         host_s_per_tensor: float = FUSED_HOST_S_PER_TENSOR):
    """Predicted step time against tensor count (fixed parameter count), measured points overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({round(10 ** (e / 8)) for e in range(0, 8 * 5 + 1)})  # 1 .. 100k tensors
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for impl, color in zip(IMPLS, ("tab:green", "tab:blue", "tab:red")):
        ax.plot(counts, [predict_step(impl, n_params, n, launch_s, bandwidth, host_s_per_tensor).seconds * 1e3
                         for n in counts], color=color, label=f"{impl} (model)")
        if measured and impl in measured:
            ax.scatter(*zip(*measured[impl]), color=color, marker="o", edgecolor="black", zorder=3,
                       label=f"{impl} (measured)")
    ax.axhline(n_params * BYTES_PER_PARAM["fused"] / bandwidth * 1e3, color="gray", ls=":",
               label="bandwidth floor (fused bytes)")
    if mark_tensors:
        ax.axvline(mark_tensors, color="gray", ls="--", lw=0.8, label=f"{mark_tensors} tensors")
    ax.set(xscale="log", yscale="log", xlabel="parameter tensors", ylabel="optimizer step (ms)",
           title=f"AdamW step time, {n_params / 1e6:.0f}M params: host-bound vs bandwidth-bound")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
