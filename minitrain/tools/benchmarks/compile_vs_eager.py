"""Does torch.compile compute the same step as eager? The first step's loss and every parameter's gradient of
one recipe (benchmarks/step.py's RECIPES), eager against compiled, on the same params and batch. A baseline
whose compiled code computes another function is not the baseline; `scripts/compile_vs_eager.py` runs this
over model variants to find the shapes and parts where that happens."""

from __future__ import annotations

import gc
from typing import Callable, Sequence

import torch

from minitrain.tools.benchmarks import step

WORST_SHOWN = 4  # parameters named with the largest gradient errors


def loss_and_grads(forward_loss: Callable, params: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    for p in params.values():
        p.grad = None
    loss = forward_loss(x, y)
    loss.backward()
    grads = {name: p.grad.detach().float().clone() for name, p in params.items() if p.grad is not None}
    return float(loss.detach()), grads


def compare(model: str, batch: int, recipe: str, extra: Sequence[str], out_dir: str) -> dict:
    """Eager, then compiled, from the same params (no optimizer step between them); gradient errors are
    relative, per parameter, against eager's."""
    trainer = step.build(model, batch, recipe, [*extra, "trainer.compile=false"], out_dir)
    try:
        x, y = trainer.train_batches.get(0)
        params = dict(trainer.model.named_parameters())
        eager_loss, eager = loss_and_grads(trainer.eager_forward_loss, params, x, y)
        torch.compiler.reset()
        compiled_loss, compiled = loss_and_grads(torch.compile(trainer.eager_forward_loss), params, x, y)
        errors = sorted(((torch.linalg.vector_norm(compiled[n] - g) / torch.linalg.vector_norm(g)).item(), n)
                        for n, g in eager.items())
        return {"model": model, "batch": batch, "recipe": recipe, "overrides": list(extra), "eager_loss": eager_loss,
                "compiled_loss": compiled_loss, "grad_rel_err_median": errors[len(errors) // 2][0],
                "grad_rel_err_worst": [{"param": n, "rel_err": e} for e, n in errors[:-WORST_SHOWN - 1:-1]]}
    finally:
        trainer.close()
        torch.compiler.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def describe(row: dict, variant: str) -> str:
    """One printed line per variant (the gpu_suite's `compile15b` keeps the lines that start with the model)."""
    worst = ", ".join(f"{w['param']} {w['rel_err']:.1e}" for w in row["grad_rel_err_worst"])
    return (f"{row['model']} {variant or '(as configured)':<40} loss eager {row['eager_loss']:.4f} compiled "
            f"{row['compiled_loss']:.4f} ({row['compiled_loss'] - row['eager_loss']:+.4f}); gradient error "
            f"median {row['grad_rel_err_median']:.1e}, worst {worst}")
