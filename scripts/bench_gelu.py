"""tanh-GELU of the GPT's MLP, forward and backward, on the GPU: torch eager, inductor, ours.

Both directions are memory streams (forward: read x, write y; backward: read grad and x, write the
input grad), so each row is shown against a device-to-device copy of the same bytes.

    python scripts/bench_gelu.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.ops import gelu_tanh  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="16384x3072", help="tokens x MLP width (gpt2-124m, B=16, T=1024)")
    ap.add_argument("--out", default="bench_gelu.json")
    args = ap.parse_args()
    shape = tuple(map(int, args.shape.split("x")))
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2
    grad = torch.randn_like(x)
    dst = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(x), return_mode="median")  # 2 x numel x 2 bytes
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
    results = []
    print(f"{torch.cuda.get_device_name()}  x {tuple(shape)} bf16; copy {copy_ms:.3f} ms "
          f"({2 * x.numel() * 2 / copy_ms / 1e9:.2f} TB/s)")
    print(f"{'impl':<12} {'fwd ms':>7} {'of copy':>7} {'bwd ms':>7} {'of floor':>8} {'fwd err':>9}")
    for name in forward:
        err = ((forward[name](x).float() - want).norm() / want.norm()).item()
        fwd_ms = triton.testing.do_bench(lambda: forward[name](x), return_mode="median")
        bwd_ms = triton.testing.do_bench(lambda: backward[name](grad, x), return_mode="median")
        row = {"impl": name, "forward_ms": fwd_ms, "forward_of_copy": copy_ms / fwd_ms,  # read x, write y
               "backward_ms": bwd_ms, "backward_of_copy": 1.5 * copy_ms / bwd_ms,  # read grad and x, write grad_in
               "forward_rel_err": err}
        results.append(row)
        print(f"{name:<12} {fwd_ms:>7.3f} {row['forward_of_copy']:>7.0%} {bwd_ms:>7.3f} "
              f"{row['backward_of_copy']:>8.0%} {err:>9.2e}")
    Path(args.out).write_text(json.dumps({"shape": shape, "copy_ms": copy_ms, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
