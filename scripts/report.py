"""Turn a sweep into a report: `python scripts/report.py <sweep dir> [--out DIR] [--wandb offline|online]`.

Writes report.md (tokens/s, MFU, HFU, predicted and measured peak memory, final loss per cell) and two
PNGs; the logic is minitrain/report.py.
"""

import argparse

from minitrain.report import write_report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep_dir", help="a Hydra multirun dir: <sweep>/<job_num>/metrics.jsonl")
    ap.add_argument("--out", default=None, help="where to write (default: the sweep dir)")
    ap.add_argument("--wandb", choices=["offline", "online"], default=None,
                    help="log the plots to wandb (default: offline if the jobs have wandb dirs, else not)")
    ap.add_argument("--project", default="minitrain")
    args = ap.parse_args()
    for name, path in write_report(args.sweep_dir, args.out, args.wandb, args.project).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
