"""Optimizer step on the GPU: ours (loop / foreach / fused) against torch's best recipes, on GPT-2-124M shapes
and on 4096 tensors of 4096 elements, each row checked against a reference update before it is timed, set
beside the device's copy bandwidth; Muon (muon-gpt2-124m, muon-gpt2-1.5b: the model's matrices through Muon, the
rest through AdamW) against torch.optim.Muon + our fused AdamW, in alternating rounds, beside its floor; Newton-Schulz
alone (ns-gpt2-124m, ns-gpt2-1.5b: the model's Muon batches) with each optimizer.muon.ns_kernel, beside the FLOP
floor (minitrain/tools/benchmarks/optimizer.py says how). `--quality RUN_DIR...`: AdamW's and Muon's runs of an lr
sweep (scripts/gpu_suite.sh muon_quality), the steps Muon's best needs to reach AdamW's best final validation loss.

    python scripts/bench_optimizer.py --out bench_optimizer.json
    python scripts/bench_optimizer.py --cases muon-gpt2-124m muon-gpt2-1.5b --out bench_muon.json
    python scripts/bench_optimizer.py --cases ns-gpt2-124m ns-gpt2-1.5b --out bench_ns_kernel.json
    python scripts/bench_optimizer.py --quality runs/multirun/adamw-sweep runs/multirun/muon-sweep --out q.json
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitrain.tools import bench  # noqa: E402
from minitrain.tools.benchmarks import optimizer  # noqa: E402


def main(argv=None):
    cases = list(optimizer.CASES) + list(optimizer.MUON_CASES) + list(optimizer.NS_CASES)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(optimizer.CASES), choices=cases)
    ap.add_argument("--rounds", type=int, default=8, help="Muon's and Newton-Schulz's cases: alternating rounds")
    ap.add_argument("--calls", type=int, default=5, help="Muon's and Newton-Schulz's cases: calls per row and round")
    ap.add_argument("--quality", nargs="+", metavar="RUN_DIR",
                    help="compare these runs' validation losses (run dirs, or sweep dirs: their cells) instead of "
                         "timing anything")
    ap.add_argument("--out", default="bench_optimizer.json")
    args = ap.parse_args(argv)
    if args.quality:
        runs = [optimizer.read_quality_run(d) for d in optimizer.quality_run_dirs(args.quality)]
        try:
            result = optimizer.quality(runs)
        except ValueError as e:
            ap.exit(2, f"error: --quality: {e}\n")
        bench.write_results(args.out, {"runs": runs, **{k: v for k, v in result.items() if k != "best"},
                                       "best": {k: v["dir"] for k, v in result["best"].items()}})
        print("\n".join(optimizer.quality_report(runs, result)))
        return
    copy_bw = bench.copy_bytes_per_s(torch.device("cuda")) / 1e12
    adamw_cases = [c for c in args.cases if c in optimizer.CASES]
    muon_cases = [c for c in args.cases if c in optimizer.MUON_CASES]
    ns_cases = [c for c in args.cases if c in optimizer.NS_CASES]
    results = {case: optimizer.run_case(optimizer.CASES[case], copy_bw) for case in adamw_cases}
    targets = optimizer.check_targets(results, copy_bw) if set(results) == set(optimizer.CASES) else {}
    gemm = optimizer.gemm_flops_per_s("cuda") if muon_cases or ns_cases else None
    muon = {case: optimizer.run_muon_case(case, copy_bw, gemm, args.rounds, args.calls) for case in muon_cases}
    muon_targets = optimizer.check_muon_targets(muon)
    ns = {case: optimizer.run_ns_case(case, gemm, args.rounds, args.calls) for case in ns_cases}
    bench.write_results(args.out, {"copy_tb_s": copy_bw, "cases": results,
                                   "targets": {k: {"value": v, "met": ok} for k, (v, ok) in targets.items()},
                                   "bf16_gemm_tflops": gemm / 1e12 if gemm else None, "muon_cases": muon,
                                   "muon_targets": {k: {"value": v, "met": ok} for k, (v, ok) in muon_targets.items()},
                                   "ns_cases": ns})
    print(f"\n{torch.cuda.get_device_name()}: device-to-device copy {copy_bw:.2f} TB/s"
          + (f", bf16 GEMM {gemm / 1e12:.0f} TFLOP/s ({optimizer.GEMM_SIZE}^3)" if gemm else ""))
    if results:
        print("\n".join(optimizer.report(results, targets)))
    if muon:
        print("\n".join(optimizer.muon_report(muon, muon_targets)))
    if ns:
        print("\n".join(optimizer.ns_report(ns)))


if __name__ == "__main__":
    main()
