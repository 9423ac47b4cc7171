"""Export a run to Hugging Face's layout: `python scripts/export_hf.py CHECKPOINT OUT_DIR`.

GPT-2's block exports as GPT2LMHeadModel; the modern block with rope + rmsnorm + swiglu + an untied head and no
biases as LlamaForCausalLM (with model.qk_norm, Qwen3ForCausalLM); any other block is refused (exit 2) naming the
option that has no transformers counterpart.

CHECKPOINT: a run dir or a checkpoint directory (its checkpoints/latest/, whatever the world size that saved it), or
Hugging Face GPT-2 weights (a directory or a name), read as scripts/sample.py and scripts/eval.py read them.
OUT_DIR (new, empty, or an earlier export, which it replaces) gets config.json, model.safetensors,
generation_config.json and the run's tokenizer, which transformers loads as they are:
AutoModelForCausalLM.from_pretrained(OUT_DIR), AutoTokenizer.from_pretrained(OUT_DIR),
pipeline("text-generation", OUT_DIR).
"""

import argparse
import sys
from pathlib import Path

from minitrain.data import DataError
from minitrain.errors import ConfigError
from minitrain.hf import export
from minitrain.rundir import TOKENIZER, RunDirError
from minitrain.weights import open_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="run dir, checkpoint dir, or Hugging Face directory or name")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--tokenizer", help=f"for a run that kept no {TOKENIZER}: the name or directory it trained with")
    args = p.parse_args()
    try:
        weights = open_weights(args.checkpoint, args.tokenizer)
        written = export(weights, args.out_dir)
    except (ConfigError, DataError, RunDirError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {weights.source} ({weights.cfg.n_layer} layers, {weights.cfg.n_embd} wide) to {args.out_dir}: "
          f"{', '.join(p.name for p in written)}")


if __name__ == "__main__":
    main()
