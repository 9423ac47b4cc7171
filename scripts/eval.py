"""Evaluate a checkpoint: `python scripts/eval.py RUN_OR_CHECKPOINT [options] [data=... data.key=value ...]`.

Validation loss and perplexity over the validation split of the run's own data config, or of the data config the
overrides give (tokenized with the run's tokenizer), and with --hellaswag the HellaSwag accuracy. The loss is
eval/val_loss: the split's consecutive windows, not the trainer's val/loss over random ones. Hugging Face GPT-2
weights (a directory or a name) are evaluated too, on the data the overrides give, with their own tokenizer.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from minitrain.cli import resolve_data
from minitrain.data import DataError
from minitrain.errors import ConfigError
from minitrain.evaluate import VAL_LOSS, VAL_PPL, VAL_TOKENS, evaluate_checkpoint
from minitrain.rundir import RunDirError
from minitrain.weights import device_problem

USAGE_EXIT_CODE = 2
# What the line printed shows of a record, in this order; --json writes the whole record.
SHOWN = {VAL_LOSS: "{:.4f}", VAL_PPL: "{:.2f}", VAL_TOKENS: "{:,}", "hellaswag/acc_norm": "{:.4f}",
         "hellaswag/acc": "{:.4f}", "hellaswag/examples": "{:,}"}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1].strip())
    ap.add_argument("checkpoint", help="a run dir (its latest checkpoint) or a checkpoint directory "
                                       "(checkpoints/latest/ or another), whatever the world size that saved it, "
                                       "or Hugging Face GPT-2 weights (a directory or a name)")
    ap.add_argument("overrides", nargs="*", help="data settings to evaluate on another corpus, as train.py takes "
                                                 "them (data=files data.paths='corpus/**/*.txt')")
    ap.add_argument("--val-tokens", type=int, default=None,
                    help="score the validation split's first N tokens, in whole windows of model.block_size "
                         "(default: all; 0: no validation loss)")
    ap.add_argument("--hellaswag", metavar="SOURCE", help="hub (downloaded once) or a local hellaswag_val.jsonl")
    ap.add_argument("--hellaswag-examples", type=int, default=None, help="the first N examples (default: all)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows (or examples) per forward")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", metavar="PATH", help="also write the results there, as one JSON object")
    return ap.parse_intermixed_args(argv)


def refusal(args: argparse.Namespace) -> Optional[str]:
    """Why these options cannot be run as given (None: they can), before a checkpoint is read."""
    for override in args.overrides:  # anything else would be composed, then silently left unused
        key = override.lstrip("+~").partition("=")[0]
        if key != "data" and not key.startswith("data."):
            return f"{override}: eval.py takes data settings only (data=NAME, data.KEY=VALUE)"
    if args.val_tokens is not None and args.val_tokens < 0:
        return f"--val-tokens must be >= 0 (0: no validation loss), got {args.val_tokens}"
    if args.val_tokens == 0 and args.hellaswag is None:
        return "nothing to evaluate: --val-tokens 0 leaves the validation loss out and no --hellaswag was given"
    if args.hellaswag_examples is not None and args.hellaswag is None:
        return "--hellaswag-examples needs --hellaswag SOURCE"
    if args.hellaswag_examples is not None and args.hellaswag_examples < 1:
        return f"--hellaswag-examples must be >= 1, got {args.hellaswag_examples}"
    if args.batch_size < 1:
        return f"--batch-size must be >= 1, got {args.batch_size}"
    return device_problem(args.device)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if (reason := refusal(args)) is not None:
        print(f"error: {reason}", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        data_cfg = resolve_data(args.overrides) if args.overrides else None
        record = evaluate_checkpoint(args.checkpoint, torch.device(args.device), data_cfg, args.val_tokens,
                                     args.hellaswag, args.hellaswag_examples, args.batch_size)
    except (ConfigError, DataError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    where = f"{args.checkpoint} at step {record['step']}" if "step" in record else args.checkpoint
    print(f"{where}: " + ", ".join(
        f"{key} {fmt.format(record[key])}" for key, fmt in SHOWN.items() if key in record))
    if args.json:
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record))
        except OSError as e:
            print(f"error: --json {args.json}: cannot write it ({e.strerror})", file=sys.stderr)
            return USAGE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
