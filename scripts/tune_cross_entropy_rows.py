"""Tune the fused loss's softmax kernels on the GPU, each beside a copy of the same bytes (the ceiling).

The row kernel reads each row twice (log-sum-exp, then the gradient) and writes it once, unless its block
holds the whole row, which it then reads once. When the rows in flight fit in L2 the second read is
nearly free: the floor is then one read and one write. This prints, per grid size (rows streaming at
once), block and warp count, the time and the bandwidth counted as one read + one write; each variant's
log-sum-exp and gradient are checked against torch's before it is timed. Then the block kernel of
`low_memory`'s pass B (one read, one write of an N x H block of logits) per tile shape and warp count.

    python scripts/tune_cross_entropy_rows.py
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.ops.cross_entropy_triton import cross_entropy_rows, logit_grad_block  # noqa: E402
from minitrain.tools import bench  # noqa: E402

GRAD_TOLERANCE = 1e-2  # relative error of a bf16 gradient
TILES = [(1, 1024), (2, 1024), (4, 512), (4, 256), (8, 256), (16, 256), (16, 128), (32, 128)]
VOCAB = 50304  # the block kernel's column offset runs within a GPT-2 vocabulary


def row_variants(vocab: int) -> list[tuple]:
    """(rows per SM, block, warps): the default launch (None: one program per row) first, then the grid, then
    one block as wide as the row."""
    whole_row = triton.next_power_of_2(vocab)  # one block: the row read once
    return ([(None, 4096, 8)] + list(itertools.product([1, 2, 3, 4, 6, 8], [2048, 4096, 8192], [4, 8, 16]))
            + list(itertools.product([1, 2, 4], [whole_row], [8, 16, 32])))


def tune_rows(shape: str, sms: int) -> list[dict]:
    """Every row-kernel variant at "rows x V": checked against torch's log-sum-exp and gradient, then timed."""
    rows, vocab = map(int, shape.split("x"))
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    work = logits.clone()  # the timed runs overwrite it with gradients; `logits` stays the checks' input
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    losses, lse = (torch.empty(rows, device="cuda") for _ in range(2))
    scale = torch.tensor(1.0 / rows, device="cuda")
    nbytes, copy_ms = 2 * logits.numel() * logits.element_size(), bench.copy_ms(logits)  # one read + one write
    print(f"{shape}: copy {copy_ms:.3f} ms = {nbytes / copy_ms / 1e9:.2f} TB/s")
    want_lse = torch.logsumexp(logits.float(), 1)
    want_grad = torch.softmax(logits.float(), 1)
    want_grad[torch.arange(rows, device="cuda"), targets] -= 1.0
    want_grad *= scale
    results = []
    for per_sm, block, warps in row_variants(vocab):
        def run(into=work, programs=None if per_sm is None else per_sm * sms, block=block, warps=warps):
            cross_entropy_rows(into, targets, losses, lse, scale, ignore_index=-100, label_smoothing=0.0,
                               z_loss=0.0, write_grad=True, programs=programs, block=block, num_warps=warps)

        checked = logits.clone()
        try:
            run(checked)
        except Exception as e:  # a block too wide for the chip's registers or shared memory
            print(f"  rows/SM {per_sm} block {block} warps {warps}: cannot run ({type(e).__name__})")
            continue
        grad_err = ((checked.float() - want_grad).norm() / want_grad.norm()).item()
        if not (torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-4) and grad_err < GRAD_TOLERANCE):
            print(f"  rows/SM {per_sm} block {block} warps {warps}: wrong (gradient error {grad_err:.1e}), not timed")
            continue
        ms = bench.kernel_ms(run)
        results.append({"shape": shape, "rows_per_sm": per_sm, "block": block, "warps": warps, "ms": ms,
                        "tb_per_s": nbytes / ms / 1e9, "of_copy": copy_ms / ms})
    base = next(r for r in results if r["rows_per_sm"] is None)
    print(f"  one program per row: {base['ms']:.3f} ms ({base['of_copy']:.0%} of copy)")
    for r in sorted(results, key=lambda r: r["ms"])[:6]:
        print(f"  rows/SM {r['rows_per_sm']} block {r['block']} warps {r['warps']}: {r['ms']:.3f} ms "
              f"({r['of_copy']:.0%} of copy)")
    return results


def tune_blocks(shape: str) -> list[dict]:
    """Pass B's block kernel at "N x H" per tile shape and warp count, beside a copy of the block."""
    rows, cols = map(int, shape.split("x"))
    block = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3
    targets = torch.randint(0, VOCAB, (rows,), device="cuda")
    lse = torch.logsumexp(block.float(), 1) + 8  # as if the row went on beyond this block
    scale = torch.tensor(1.0 / rows, device="cuda")
    copy_ms = bench.copy_ms(block)
    print(f"block {shape}: copy {copy_ms:.4f} ms")
    results = []
    for tile, warps in itertools.product(TILES, [4, 8]):
        ms = bench.kernel_ms(lambda: logit_grad_block(block, 0, VOCAB, targets, lse, scale, ignore_index=-100,
                                                      label_smoothing=0.0, z_loss=0.0, tile=tile, num_warps=warps))
        results.append({"block": shape, "tile": tile, "warps": warps, "ms": ms, "of_copy": copy_ms / ms})
        print(f"  tile {tile} warps {warps}: {ms:.4f} ms ({copy_ms / ms:.0%} of copy)")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["2560x50304", "16384x50304", "1024x128256"],
                    help="row-kernel shapes, rows x V (none: only the block kernel)")
    ap.add_argument("--blocks", nargs="*", default=["16384x768", "8192x2048", "32768x2048"],
                    help="pass B blocks, N x H")
    ap.add_argument("--out", default="tune_cross_entropy_rows.json")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = [r for shape in args.shapes for r in tune_rows(shape, sms)]
    results += [r for shape in args.blocks for r in tune_blocks(shape)]
    bench.write_results(args.out, {"rows": results})


if __name__ == "__main__":
    main()
