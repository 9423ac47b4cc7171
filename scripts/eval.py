"""Evaluate a checkpoint: `python scripts/eval.py RUN_OR_CHECKPOINT [options] [data=... data.key=value ...]`.

Validation loss and perplexity over the validation split of the run's own data config, or of the data config the
overrides give (tokenized with the run's tokenizer), and with --hellaswag the HellaSwag accuracy.
"""

import argparse
import json
import sys

import torch

from minitrain.config import ConfigError, resolve_data
from minitrain.data import DataError
from minitrain.evaluate import evaluate_checkpoint
from minitrain.rundir import RunDirError

USAGE_EXIT_CODE = 2


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1].strip())
    ap.add_argument("checkpoint", help="a run dir (its latest checkpoint) or a checkpoint directory "
                                       "(checkpoints/latest/ or another), whatever the world size that saved it")
    ap.add_argument("overrides", nargs="*", help="data settings to evaluate on another corpus, as train.py takes "
                                                 "them (data=files data.paths='corpus/**/*.txt')")
    ap.add_argument("--val-tokens", type=int, default=None, help="the validation split's first N tokens "
                                                                 "(default: all; 0: no validation loss)")
    ap.add_argument("--hellaswag", metavar="SOURCE", help="hub (downloaded once) or a local hellaswag_val.jsonl")
    ap.add_argument("--hellaswag-examples", type=int, default=None, help="the first N examples (default: all)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows (or examples) per forward")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", metavar="PATH", help="also write the results there, as one JSON object")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        data_cfg = resolve_data(args.overrides) if args.overrides else None
        record = evaluate_checkpoint(args.checkpoint, torch.device(args.device), data_cfg, args.val_tokens,
                                     args.hellaswag, args.hellaswag_examples, args.batch_size)
    except (ConfigError, DataError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    shown = {"val/loss": "{:.4f}", "val/ppl": "{:.2f}", "val/tokens": "{:,}", "hellaswag/acc_norm": "{:.4f}",
             "hellaswag/acc": "{:.4f}", "hellaswag/examples": "{:,}"}
    print(f"{args.checkpoint} at step {record['step']}: " + ", ".join(
        f"{key} {fmt.format(record[key])}" for key, fmt in shown.items() if key in record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
