"""Turn a sweep into a report: `python scripts/report.py <sweep dir or run dir> [--out DIR] [--wandb offline|online]`.

Writes report.md (tokens/s, MFU, HFU, predicted and measured peak memory, final loss per cell) and its PNGs
(throughput against memory, memory by term, loss curves, and the loss scale of fp16 cells), and prints report.md;
the logic is minitrain/tools/report.py.
"""

import argparse
import sys

from minitrain.tools.report import PLOTS_SKIPPED, ReportError, plotting_available, write_report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep_dir", help="a Hydra multirun dir (<sweep>/<job_num>/metrics.jsonl), or one run's dir")
    ap.add_argument("--out", default=None, help="where to write (default: the sweep dir)")
    ap.add_argument("--wandb", choices=["offline", "online"], default=None,
                    help="log the plots to wandb (default: offline if the jobs have wandb dirs, else not)")
    ap.add_argument("--project", default="minitrain", help="the wandb project to log to")
    args = ap.parse_args(argv)
    try:
        files = write_report(args.sweep_dir, args.out, args.wandb, args.project)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(files["report"].read_text())
    for name, path in files.items():
        print(f"{name}: {path}")
    if not plotting_available():
        print(PLOTS_SKIPPED)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
