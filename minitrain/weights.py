"""A trained model read back: a run dir, one of its checkpoints, or Hugging Face GPT-2 weights -> `Weights`.

The one reader of scripts/sample.py, scripts/export_hf.py and scripts/eval.py, so that the three read any source
alike: the same config, tensors and tokenizer. A minitrain checkpoint brings its run's settled model config (shape
and vocab as the run resolved them), its weights whole (whatever the world size that saved them), the run's
tokenizer (its run dir's tokenizer.json) and what the run recorded (config, step); Hugging Face weights (a
directory or a hub name) are read through minitrain/hf.py's layout and bring their own tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from .checkpoint import CheckpointError, locate, read_part
from .errors import error_reason
from .hf import CONFIG, KEY, load_weights, settle_shape
from .hub import SourceError, is_hub_name
from .model_config import ModelConfig
from .rundir import CHECKPOINTS, JOB_INFO, LATEST, METRICS, PREVIOUS, TOKENIZER

# What tells a run dir or a checkpoint from Hugging Face weights: a checkpoint's own files (DCP's `.metadata`
# beside the shards), a run dir's checkpoints/ (or its metrics, before its first save), a checkpoints/ folder's own.
RUN_MARKS = (JOB_INFO, ".metadata", CHECKPOINTS, METRICS, LATEST, PREVIOUS)


def device_problem(name: str) -> Optional[str]:
    """What is wrong with a script's --device NAME on this machine, in one line (None: it can be used)."""
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device string
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        return f"--device must be cpu, cuda or cuda:N, got {name!r}"
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        return f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


@dataclass(frozen=True)
class SavedRun:
    """What a minitrain checkpoint records of the run that saved it, beyond its model."""

    config: dict  # the run's resolved config, as its minitrain.json holds it
    step: int
    run_dir: Path  # the directory holding checkpoints/ (and the run's tokenizer.json)


@dataclass
class Weights:
    """A model's settled config, its state dict in minitrain's names (on the CPU), its tokenizer and where they
    came from."""

    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer: object  # tokenizers.Tokenizer; None for a run that kept none, read without one (open_weights)
    source: Path  # the checkpoint's directory, or the weights file
    run: Optional[SavedRun] = None  # a minitrain checkpoint's; None for Hugging Face weights
    tokenizer_source: Optional[str] = None  # the name or directory the tokenizer was read from

    def build(self, device: torch.device, dtype: torch.dtype | None = None, **changes):
        """The GPT on `device` in `dtype` (the weights' own when None), in eval mode; `changes`: ModelConfig
        fields that do not change the function (gelu, qk_kernel)."""
        from .model import GPT

        with torch.device(device):
            model = GPT(replace(self.cfg, **changes))
        model.load_state_dict(self.state)
        return model.to(dtype or next(iter(self.state.values())).dtype).eval()


def open_weights(source: str, tokenizer: str | None = None, need_tokenizer: bool = True) -> Weights:
    """A run dir, a checkpoint (its checkpoints/latest/ or another), or Hugging Face weights (GPT-2, or Llama/Qwen3
    of the modern block; a directory or a name); `tokenizer` (a name or directory) instead of the source's own, and for a run that kept none beside its
    checkpoints, which is refused unless not `need_tokenizer` (its Weights.tokenizer is then None)."""
    path = Path(source).expanduser()
    if any((path / mark).exists() for mark in RUN_MARKS):
        return read_checkpoint(path, tokenizer, need_tokenizer)
    if path.is_dir() and not (path / CONFIG).is_file():
        raise SourceError(f"{source}: neither a run dir ({CHECKPOINTS}/), a checkpoint ({JOB_INFO}) nor Hugging "
                          f"Face weights ({CONFIG})")
    if not path.exists() and not is_hub_name(source):
        raise SourceError(f"{source}: no such run dir or checkpoint, nor Hugging Face weights ({KEY}={source!r}: "
                          "no such directory, and not a Hugging Face model name)")
    return read_hf(source, tokenizer)


def read_hf(source: str, tokenizer: str | None = None) -> Weights:
    """Hugging Face GPT-2 weights (a directory or a hub name) with their own tokenizer, or `tokenizer`."""
    from .data.tokenizer import pretrained_tokenizer
    from .model import GPT

    cfg = settle_shape(ModelConfig(name=source, init_from=source, n_layer=None, n_head=None, n_embd=None,
                                   block_size=None))
    with torch.device("meta"):
        skeleton = GPT(cfg)
    model = skeleton.to_empty(device="cpu")
    weights_path = load_weights(model)
    return Weights(cfg, model.state_dict(), pretrained_tokenizer(tokenizer or source), weights_path,
                   tokenizer_source=tokenizer or source)


def read_checkpoint(path: Path, tokenizer: str | None = None, need_tokenizer: bool = True) -> Weights:
    """The model of a minitrain checkpoint (a run dir's latest, or the checkpoint `path` names): its config (shape
    and vocab as the run settled them), its weights (whole, whatever the world size that saved them), its step, and
    the run's tokenizer (saved beside checkpoints/ by the trainer), else `tokenizer`."""
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.api import CheckpointException

    from .data.tokenizer import pretrained_tokenizer

    ckpt = locate(path)
    try:
        config = json.loads((ckpt / JOB_INFO).read_text())["config"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{ckpt / JOB_INFO} is unreadable ({error_reason(e)})") from None
    try:
        state, step = read_part(ckpt, "model"), read_part(ckpt, "progress_rank0")["step"]
    except (Exception, CheckpointException) as e:  # a torn shard, a missing part (DCP's own is a BaseException)
        if isinstance(e, CheckpointException):  # it wraps what the reader raised
            e, _ = next(iter(e.failures.values()))
        raise CheckpointError(f"{ckpt} could not be read ({error_reason(e)})") from None
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), config["model"]))
        cfg = replace(cfg, vocab_size=config["plan"]["vocab_size"])
    except Exception as e:  # a config of another version: OmegaConf's validation errors, a missing key
        raise CheckpointError(f"{ckpt}: its config is not one this minitrain reads ({error_reason(e)})") from None
    run_dir = ckpt.parent.parent
    kept = (run_dir / TOKENIZER).is_file()
    if tokenizer is None and not kept and need_tokenizer:
        raise SourceError(f"{ckpt}: its run keeps no {TOKENIZER} (written by runs since 2026-12-03); name the one "
                          "it was trained with (--tokenizer gpt2, or the data cache's directory)")
    named = tokenizer or (str(run_dir) if kept else None)
    return Weights(cfg, {k: v.cpu() for k, v in state.items()}, pretrained_tokenizer(named) if named else None, ckpt,
                   SavedRun(config, step, run_dir), named)
