"""Does torch.compile compute the same step as eager? The first step's loss and every parameter's gradient of
one recipe (scripts/bench_step.py's RECIPES), eager against compiled, on the same params and batch, for a list
of model variants. A baseline whose compiled code computes another function is not the baseline; this finds
the shapes and parts where that happens. Prints one line per variant and writes JSON to --out.

    python scripts/compile_vs_eager.py --model gpt2-1.5b --batch 8 --variants "model.n_layer=4" \\
        "model.n_layer=4 model.n_embd=1024 model.n_head=16"
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_step  # noqa: E402


def loss_and_grads(forward_loss, params: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    for p in params.values():
        p.grad = None
    loss = forward_loss(x, y)
    loss.backward()
    return float(loss.detach()), {name: p.grad.detach().float().clone() for name, p in params.items()
                                  if p.grad is not None}


def compare(model: str, batch: int, recipe: str, extra: list[str], out_dir: str) -> dict:
    """Eager, then compiled, from the same params (no optimizer step between them); gradient errors are
    relative, per parameter, against eager's."""
    trainer = bench_step.build(model, batch, recipe, [*extra, "trainer.compile=false"], out_dir)
    try:
        x, y = trainer.train_batches.get(0)
        params = dict(trainer.model.named_parameters())
        eager_loss, eager = loss_and_grads(trainer._forward_loss, params, x, y)
        torch._dynamo.reset()
        compiled_loss, compiled = loss_and_grads(torch.compile(trainer._forward_loss), params, x, y)
        errors = sorted(((torch.linalg.vector_norm(compiled[n] - g) / torch.linalg.vector_norm(g)).item(), n)
                        for n, g in eager.items())
        return {"model": model, "batch": batch, "recipe": recipe, "overrides": extra, "eager_loss": eager_loss,
                "compiled_loss": compiled_loss, "grad_rel_err_median": errors[len(errors) // 2][0],
                "grad_rel_err_worst": [{"param": n, "rel_err": e} for e, n in errors[:-5:-1]]}
    finally:
        trainer.close()
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--recipe", choices=sorted(bench_step.RECIPES), default="reference")
    ap.add_argument("--variants", nargs="+", default=[""], help="space-separated overrides per variant ('': the model)")
    ap.add_argument("--out", default="compile_vs_eager.json")
    args = ap.parse_args()
    rows = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as out_dir:
            row = compare(args.model, args.batch, args.recipe, variant.split(), out_dir)
        rows.append(row)
        worst = ", ".join(f"{w['param']} {w['rel_err']:.1e}" for w in row["grad_rel_err_worst"])
        print(f"{args.model} {variant or '(as configured)':<40} loss eager {row['eager_loss']:.4f} compiled "
              f"{row['compiled_loss']:.4f} ({row['compiled_loss'] - row['eager_loss']:+.4f}); gradient error "
              f"median {row['grad_rel_err_median']:.1e}, worst {worst}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
