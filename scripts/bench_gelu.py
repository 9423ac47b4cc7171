"""tanh-GELU of the GPT's MLP, forward and backward, on the GPU: torch eager, inductor, ours.

Both directions are memory streams (forward: read x, write y; backward: read grad and x, write the
input grad), so each row is shown against a device-to-device copy of the same bytes.

    python scripts/bench_gelu.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.ops import gelu_tanh  # noqa: E402
from minitrain.tools import bench  # noqa: E402

TABLE = (bench.Column("impl", "impl"), bench.Column("fwd ms", "forward_ms", ".3f"),
         bench.Column("of copy", "forward_of_copy", ".0%"), bench.Column("bwd ms", "backward_ms", ".3f"),
         bench.Column("of floor", "backward_of_copy", ".0%"), bench.Column("fwd err", "forward_rel_err", ".2e"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="16384x3072", help="tokens x MLP width (gpt2-124m, B=16, T=1024)")
    ap.add_argument("--out", default="bench_gelu.json")
    args = ap.parse_args()
    shape = tuple(map(int, args.shape.split("x")))
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2
    grad = torch.randn_like(x)
    copy_ms = bench.copy_ms(x)  # 2 x numel x 2 bytes
    forward = {
        "torch eager": lambda t: F.gelu(t, approximate="tanh"),
        "inductor": torch.compile(lambda t: F.gelu(t, approximate="tanh")),
        "ours": gelu_tanh,
    }
    backward = {
        "torch eager": lambda g, t: torch.ops.aten.gelu_backward(g, t, approximate="tanh"),
        "inductor": torch.compile(lambda g, t: torch.ops.aten.gelu_backward(g, t, approximate="tanh")),
        "ours": torch.ops.minitrain.gelu_tanh_backward,
    }
    want = F.gelu(x.float(), approximate="tanh")
    rows = []
    for name in forward:
        err = ((forward[name](x).float() - want).norm() / want.norm()).item()
        fwd_ms = bench.kernel_ms(lambda: forward[name](x))
        bwd_ms = bench.kernel_ms(lambda: backward[name](grad, x))
        rows.append({"impl": name, "forward_ms": fwd_ms, "forward_of_copy": copy_ms / fwd_ms,  # read x, write y
                     "backward_ms": bwd_ms,
                     "backward_of_copy": 1.5 * copy_ms / bwd_ms,  # read grad and x, write grad_in
                     "forward_rel_err": err})
    bench.write_results(args.out, {"shape": shape, "copy_ms": copy_ms, "rows": rows})
    print(f"{torch.cuda.get_device_name()}  x {tuple(shape)} bf16; copy {copy_ms:.3f} ms "
          f"({2 * x.numel() * 2 / copy_ms / 1e9:.2f} TB/s)")
    print("\n".join(bench.table(rows, TABLE)))


if __name__ == "__main__":
    main()
