"""The optimizer group's typed config (optimizer=adamw | muon), each default written once, as minitrain/config.py's
groups are; config.py composes it into the run's Config."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import List

from .errors import require


class OptimizerImpl(str, Enum):
    auto = "auto"  # fused on CUDA, foreach on CPU
    fused = "fused"
    foreach = "foreach"
    loop = "loop"
    torch = "torch"  # torch.optim.AdamW + torch.amp.GradScaler: the plain-PyTorch baseline


class OptimizerName(str, Enum):
    adamw = "adamw"  # AdamW on every parameter
    muon = "muon"  # Muon on the blocks' 2-D weights, AdamW on the rest (minitrain/optim/muon.py)


class MuonAdjustLR(str, Enum):
    """torch.optim.Muon's adjust_lr_fn: how a matrix's shape scales Muon's lr (minitrain/optim/newton_schulz.py)."""

    original = "original"  # Keller Jordan's sqrt(max(1, rows / cols))
    match_rms_adamw = "match_rms_adamw"  # Moonshot's 0.2 * sqrt(max(rows, cols)): an AdamW-sized update


class MuonNSKernel(str, Enum):
    """Who computes Newton–Schulz's symmetric products, X Xᵀ and b·A + c·A·A (minitrain/optim/newton_schulz.py)."""

    cublas = "cublas"  # torch's batched GEMMs (cuBLAS on a GPU): every tile of both
    triton = "triton"  # minitrain's Triton kernels: the tiles on and above the diagonal, mirrored (half the FLOPs)


@dataclass
class MuonConfig:
    """optimizer=muon: Muon on every 2-D weight inside the blocks (each block's four linears); the embeddings, the
    tied head, the norms and the biases keep AdamW (optimizer.betas, optimizer.eps) at trainer.lr."""

    # Keller Jordan's Muon (github.com/KellerJordan/Muon: the Muon class's and its README's lr, with the `original`
    # adjustment). The schedule scales it by the factor it scales trainer.lr by: warmup and cosine alike.
    lr: float = 0.02
    momentum: float = 0.95  # torch.optim.Muon's default (Keller Jordan's)
    nesterov: bool = True  # torch.optim.Muon's default (Keller Jordan's)
    ns_steps: int = 5  # Newton–Schulz steps: torch.optim.Muon's default (Keller Jordan's)
    # The quintic's (a, b, c): torch.optim.Muon's defaults (Keller Jordan's, the largest slope at zero).
    ns_coefficients: List[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    ns_eps: float = 1e-7  # the Frobenius norm's floor before Newton–Schulz: torch.optim.Muon's eps
    adjust_lr: MuonAdjustLR = MuonAdjustLR.original  # torch.optim.Muon's default adjust_lr_fn
    # cublas: the triton kernels skip half of X Xᵀ and A·A, faster on gpt2-1.5b's matrices, slower on gpt2-124m's
    # (docs/benchmarks.md, Muon); on a CPU they need Triton's interpreter (TRITON_INTERPRET=1).
    ns_kernel: MuonNSKernel = MuonNSKernel.cublas
    # Decoupled, p *= 1 - lr * weight_decay with Muon's lr: Keller Jordan's README (its MuonWithAuxAdam example),
    # 2e-4 a step at lr 0.02, the order of AdamW's 1e-4 (0.1 at trainer.lr 1e-3); torch.optim.Muon's 0.1 goes with
    # its lr of 1e-3.
    weight_decay: float = 0.01

    def __post_init__(self):
        require(self.lr > 0, "optimizer.muon.lr", f"must be > 0, got {self.lr}")
        require(0.0 <= self.momentum < 1.0, "optimizer.muon.momentum", f"must be in [0, 1), got {self.momentum}")
        require(1 <= self.ns_steps < 100, "optimizer.muon.ns_steps", f"must be in [1, 100), got {self.ns_steps}")
        require(len(self.ns_coefficients) == 3, "optimizer.muon.ns_coefficients",
                f"needs the quintic's three coefficients (a, b, c), got {list(self.ns_coefficients)}")
        require(self.ns_eps > 0, "optimizer.muon.ns_eps", f"must be > 0, got {self.ns_eps}")
        require(self.weight_decay >= 0, "optimizer.muon.weight_decay", f"must be >= 0, got {self.weight_decay}")


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adamw  # configs/optimizer/<name>.yaml
    # Both sides of muon alike.
    impl: OptimizerImpl = OptimizerImpl.auto
    # AdamW's, and with optimizer=muon its side's (the embeddings, norms and biases, at trainer.lr).
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1  # on AdamW's matrices; with optimizer=muon they are Muon's (optimizer.muon.weight_decay)
    max_grad_norm: float = 1.0  # 0 disables clipping (the norm is still logged); one norm over both sides of muon
    muon: MuonConfig = field(default_factory=MuonConfig)  # optimizer=muon only

    def __post_init__(self):
        require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "optimizer.betas",
                f"need two values in [0, 1), got {list(self.betas)}")
        require(self.eps > 0, "optimizer.eps", f"must be > 0, got {self.eps}")
        require(self.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(self.max_grad_norm >= 0, "optimizer.max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        default = MuonConfig()
        unused = [f.name for f in fields(MuonConfig) if getattr(self.muon, f.name) != getattr(default, f.name)]
        require(self.name == OptimizerName.muon or not unused, f"optimizer.muon.{(unused or [''])[0]}",
                f"is set, but optimizer={self.name.value} does not use it: add optimizer=muon, or drop the setting")
        require(not (self.name == OptimizerName.muon and self.impl == OptimizerImpl.torch), "optimizer.impl",
                "torch is the plain-PyTorch AdamW baseline; with optimizer=muon use auto, fused, foreach or loop "
                "(scripts/bench_optimizer.py sets Muon beside torch.optim.Muon)")
