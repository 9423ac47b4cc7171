"""Predict an AdamW step: per-tensor vs foreach vs fused, host-bound vs bandwidth-bound, and its memory; then what
Muon costs beside AdamW per parameter of a model's hidden matrices (FLOPs, bytes moved, state) and its floor.

`python scripts/optimizer_widget.py [--params N] [--tensors K] [--launch-us U] [--host-us-per-tensor H]
[--bandwidth-tbs B] [--gemm-tflops G] [--model gpt2-124m] [--ns-steps S] [--measured bench_optimizer.json]
[--out optimizer_widget.png]`; defaults: GPT-2 124M, H200 values. The model is minitrain/tools/optimizer_model.py;
the plot needs matplotlib (the `plots` extra).
"""

import argparse
import importlib.util
import json

from minitrain.tools import optimizer_model as om
from minitrain.optimizer_config import MuonConfig
from minitrain.memory import hidden_shapes, param_numels
from minitrain.model_config import ModelConfig
from minitrain.tools.benchmarks.optimizer import MUON_MODELS


def gpt2_124m() -> tuple[int, int]:
    numels = [n for group, _ in param_numels(ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024,
                                                           vocab_size=50304)) for n in group]
    return sum(numels), len(numels)


def main() -> None:
    params, tensors = gpt2_124m()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=params)
    ap.add_argument("--tensors", type=int, default=tensors)
    ap.add_argument("--launch-us", type=float, default=om.DEFAULT_LAUNCH_S * 1e6)
    ap.add_argument("--host-us-per-tensor", type=float, default=om.FUSED_HOST_S_PER_TENSOR * 1e6,
                    help="the fused step's host time per parameter tensor")
    ap.add_argument("--bandwidth-tbs", type=float, default=om.DEFAULT_BANDWIDTH / 1e12)
    ap.add_argument("--gemm-tflops", type=float, default=om.DEFAULT_GEMM_FLOPS / 1e12,
                    help="the bf16 GEMM rate Muon's Newton-Schulz runs at")
    ap.add_argument("--model", default="gpt2-124m", choices=list(MUON_MODELS),
                    help="whose hidden matrices Muon's costs are counted over")
    ap.add_argument("--ns-steps", type=int, default=MuonConfig.ns_steps,
                    help="Muon's Newton-Schulz steps (optimizer.muon.ns_steps)")
    ap.add_argument("--measured", default=None, help="scripts/bench_optimizer.py's JSON, overlaid on the plot")
    ap.add_argument("--out", default="optimizer_widget.png")
    args = ap.parse_args()
    launch_s, bandwidth, per_tensor = args.launch_us * 1e-6, args.bandwidth_tbs * 1e12, args.host_us_per_tensor * 1e-6
    measured = None
    if args.measured:
        with open(args.measured) as f:
            measured = om.measured_points(json.load(f))
    print(om.table(args.params, args.tensors, launch_s, bandwidth, per_tensor))
    print(om.cost_table(hidden_shapes(MUON_MODELS[args.model]), args.gemm_tflops * 1e12, bandwidth,
                       args.ns_steps))
    if importlib.util.find_spec("matplotlib") is None:
        print("plot skipped: matplotlib is not installed (pip install -e '.[plots]')")
        return
    print(f"plot: {om.plot(args.params, args.out, launch_s, bandwidth, measured, args.tensors, per_tensor)}")


if __name__ == "__main__":
    main()
