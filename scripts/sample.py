"""Sample from a GPT: `python scripts/sample.py SOURCE --prompt "def main(" --max-new-tokens 200`.

SOURCE: a run dir, a checkpoint directory (checkpoints/latest/ or another), or Hugging Face GPT-2 weights (a
directory, or a name such as gpt2), or Llama/Qwen3 ones whose block minitrain's expresses (minitrain/hf.py). bf16
on a GPU with the decode step in Triton kernels replayed as one CUDA graph, fp32 on a CPU.
"""

import argparse
import sys
from pathlib import Path

import torch

from minitrain.data import DataError
from minitrain.errors import ConfigError
from minitrain.generate import DEFAULT_NEW_TOKENS, GenerationError, Sampling, sample_texts
from minitrain.model_config import KernelImpl
from minitrain.rundir import TOKENIZER, RunDirError
from minitrain.weights import device_problem, open_weights

USAGE_EXIT_CODE = 2


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="run dir, checkpoint, Hugging Face directory or name")
    p.add_argument("--prompt", default="", help="the text to continue (empty: a new document)")
    p.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default: {DEFAULT_NEW_TOKENS}, or as many as the model's context leaves after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--num-samples", type=int, default=1, help="continuations, drawn as one batch")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--no-kv-cache", action="store_true", help="rerun the whole sequence at every token")
    p.add_argument("--no-compile", action="store_true",
                   help="on a GPU: decode eagerly through the model's own forward, without the decode kernels' CUDA "
                        "graph (for comparing, or where Triton cannot compile)")
    p.add_argument("--tokenizer", help=f"for a run that kept no {TOKENIZER}: the name or directory it trained with")
    return p.parse_args(argv)


def out_of_range(args: argparse.Namespace) -> str | None:
    """The first option outside the values it can take, said in one line (before any weights load)."""
    for option, value, ok, allowed in [
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens is None or args.max_new_tokens >= 1, ">= 1"),
            ("--temperature", args.temperature, args.temperature >= 0, ">= 0 (0: greedy)"),
            ("--top-k", args.top_k, args.top_k >= 1, ">= 1"),
            ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]"),
            ("--num-samples", args.num_samples, args.num_samples >= 1, ">= 1")]:
        if not ok:
            return f"{option} must be {allowed}, got {value}"
    return device_problem(args.device)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if (problem := out_of_range(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        prompt = args.prompt_file.read_text() if args.prompt_file else args.prompt
        device = torch.device(args.device)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype) or \
            (torch.bfloat16 if device.type == "cuda" else torch.float32)
        weights = open_weights(args.source, args.tokenizer)
        model = weights.build(device, dtype, gelu=KernelImpl.torch)  # inductor fuses the GELU into the decode step
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        texts, out = sample_texts(model, weights.tokenizer, prompt, args.num_samples, args.max_new_tokens, sampling,
                                  args.seed, kv_cache=not args.no_kv_cache, graphs=False if args.no_compile else None)
    except (ConfigError, DataError, GenerationError, RunDirError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    for text in texts:
        print(text, end="\n---------------\n", flush=True)
    fitted = "" if out.new_tokens == (args.max_new_tokens or DEFAULT_NEW_TOKENS) else \
        f", not the default {DEFAULT_NEW_TOKENS}: all that the model's context of {model.cfg.block_size} tokens " \
        "leaves after the prompt"
    print(f"{weights.source} on {device} ({str(dtype).removeprefix('torch.')}): prefill {out.prefill_s * 1e3:.1f} ms, "
          f"decode {out.decode_tokens_per_s:,.0f} tokens/s ({args.num_samples} x {out.new_tokens} new tokens{fitted})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
