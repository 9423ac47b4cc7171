"""Evaluation beyond the training loss: validation loss and perplexity over a split, and HellaSwag accuracy.

Validation loss here is exact and deterministic: the mean token loss over consecutive windows covering a split
(or its first tokens), not a sample of random windows as the trainer's periodic `val/loss` is. Two estimators, so
two names: this one is `eval/val_loss` (and `eval/val_ppl`, `eval/val_tokens`), never to be read as the other.

HellaSwag (Zellers et al., 2019): a context and four endings, one of them right. Scored as EleutherAI's
lm-evaluation-harness scores its `hellaswag` task, zero-shot, so that the numbers compare with the papers that
report it: the context is `activity_label: ctx_a Ctx_b` and each ending is cleaned of WikiHow's bracketed
markup (the harness's `preprocess`); each ending, after a space, is scored as a continuation of the context (the
context and the continuation tokenized together, the continuation's tokens those after the context's own), by
its summed log-likelihood. `acc` picks the ending of highest log-likelihood, `acc_norm` the highest
log-likelihood per character of the ending. llm.c and nanoGPT-derived trainers report another `acc_norm`: the
raw `ctx` as context and the mean log-likelihood per token. Beyond the harness, which refuses one, an ending
longer than the block is scored on its last block_size tokens.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from .config import DataConfig
from .data import DataError, TokenData, TokenStream, prepare_data
from .data.corpus import hub_quietly
from .model import GPT
from .precision import preset, resolve_precision
from .rundir import TOKENIZER
from .weights import Weights, open_weights

# The validation set on the hub: the parquet copy the hub made of the original jsonl (activity_label, ctx_a, ctx_b,
# endings, label, ...).
HELLASWAG_REPO, HELLASWAG_REVISION = "Rowan/hellaswag", "refs/convert/parquet"
HELLASWAG_FILE = "default/validation/0000.parquet"

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # token ids (B, T) -> logits (B, T, vocab)
# validation_loss's record: the split's consecutive windows, not the trainer's random ones (`val/loss`)
VAL_LOSS, VAL_PPL, VAL_TOKENS = "eval/val_loss", "eval/val_ppl", "eval/val_tokens"


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows (a diverged model), NaN for a NaN loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def validation_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokens: TokenStream,
                    block_size: int, batch_size: int, device: torch.device,
                    max_tokens: Optional[int] = None) -> dict[str, float]:
    """Mean token loss over the consecutive windows of `block_size` predictions covering the first `max_tokens`
    predictions (default: all) of `tokens` (a window reads block_size + 1 tokens, its last the next window's
    first); `loss_fn(inputs, targets)` is each prediction's loss. They are summed in float64 (a float32 loss
    holds 24 significant bits: at a loss's magnitudes their sum is exact in any order), so that the batching adds
    no rounding of its own."""
    usable = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    n_windows = (usable - 1) // block_size
    if n_windows == 0:
        if usable < len(tokens):
            raise DataError(f"{max_tokens} validation tokens asked for, fewer than one window of "
                            f"model.block_size={block_size}: ask for at least {block_size}")
        raise DataError(f"the validation split holds {len(tokens)} tokens, fewer than one window of "
                        f"model.block_size={block_size} + 1")
    total = 0.0
    for first in range(0, n_windows, batch_size):
        rows = min(batch_size, n_windows - first)
        windows = np.empty((rows, block_size + 1), dtype=np.int64)
        for row in range(rows):
            tokens.read((first + row) * block_size, windows[row])
        ids = torch.from_numpy(windows).to(device)
        total += float(loss_fn(ids[:, :-1], ids[:, 1:]).double().sum())
    loss = total / (n_windows * block_size)
    return {VAL_LOSS: loss, VAL_PPL: perplexity(loss), VAL_TOKENS: n_windows * block_size}


@dataclass(frozen=True)
class HellaSwagExample:
    context: str  # the harness's query: "activity_label: ctx_a Ctx_b", cleaned
    endings: tuple[str, ...]  # cleaned, without the space that joins each to the context
    label: int


def _harness_text(text: str) -> str:
    """lm-evaluation-harness's HellaSwag `preprocess`: a WikiHow `[title]` as a sentence's end, the rest of the
    bracketed markup (`[header]`, `[step]`, ...) dropped, double spaces made single."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _example(row: dict, where: str) -> HellaSwagExample:
    try:
        context = _harness_text(f"{row['activity_label']}: {row['ctx_a']} {str(row['ctx_b']).capitalize()}")
        endings, label = tuple(_harness_text(str(e)) for e in row["endings"]), int(row["label"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{where}: not a HellaSwag example ({type(e).__name__}: {e}); each needs activity_label, "
                        "ctx_a, ctx_b, endings and label") from None
    if not 0 <= label < len(endings):
        raise DataError(f"{where}: label {label} names none of its {len(endings)} endings")
    return HellaSwagExample(context, endings, label)


def load_hellaswag(source: str, limit: Optional[int] = None) -> list[HellaSwagExample]:
    """The first `limit` (default: all) validation examples, from the hub (`hub`) or a local jsonl file with
    activity_label, ctx_a, ctx_b, endings and label on each line (hellaswag_val.jsonl as its authors publish it)."""
    if source == "hub":
        import pyarrow.parquet as pq

        rows = pq.read_table(_download_hellaswag()).to_pylist()
        examples = [_example(row, f"{HELLASWAG_REPO} row {i}") for i, row in enumerate(rows[:limit])]
    else:
        path = Path(source).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise DataError(f"trainer.eval_hellaswag={source!r}: cannot read it ({e.strerror}); give hub or the "
                            "path of a local copy (hellaswag_val.jsonl)") from None
        examples = []
        for i, line in enumerate(lines, 1):
            if line.strip() and (limit is None or len(examples) < limit):
                try:
                    row = json.loads(line)
                except ValueError:
                    raise DataError(f"{path}:{i}: not a JSON line") from None
                examples.append(_example(row, f"{path}:{i}"))
    if not examples:
        raise DataError(f"HellaSwag source {source!r} holds no example")
    return examples


def _download_hellaswag() -> str:
    """The validation split's parquet file: from the local cache when it is there (no network), else from the
    hub, announced first, as an unreachable hub takes about half a minute of retries to say so."""
    from huggingface_hub import hf_hub_download

    where = dict(repo_id=HELLASWAG_REPO, filename=HELLASWAG_FILE, repo_type="dataset", revision=HELLASWAG_REVISION)
    try:
        return hf_hub_download(**where, local_files_only=True)
    except Exception:  # not cached yet
        pass
    print(f"HellaSwag: downloading {HELLASWAG_REPO}'s validation split from the hub (once, then from its cache)",
          file=sys.stderr, flush=True)
    try:
        with hub_quietly():
            return hf_hub_download(**where)
    except Exception as e:  # offline, or the hub moved it: either way the local copy is the way out
        raise DataError(f"HellaSwag could not be downloaded from the hub ({type(e).__name__}); it needs network "
                        "once. Offline, point at a local copy instead: hellaswag_val.jsonl from "
                        "github.com/rowanz/hellaswag (data/), one example per line with activity_label, "
                        "ctx_a, ctx_b, endings and label") from None


def _continuation_ids(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's and the continuation's token ids as the harness splits them: the context's trailing
    whitespace moved to the continuation, the two encoded together, the continuation's ids those past the
    context's own (with a pre-tokenizer that splits before a space, as GPT-2's does, the ids of each encoded
    alone)."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    whole = tokenizer.encode(stripped + continuation, add_special_tokens=False).ids
    context_ids = tokenizer.encode(stripped, add_special_tokens=False).ids
    return context_ids, whole[len(context_ids):]


def _rows(tokenizer, example: HellaSwagExample, block_size: int) -> list[tuple[list[int], int]]:
    """Each ending's token row (the context, then " " + the ending), kept to its last block_size + 1 tokens,
    and where the ending starts in it."""
    rows = []
    for ending in example.endings:
        context, completion = _continuation_ids(tokenizer, example.context, " " + ending)
        row = (context + completion)[-(block_size + 1):]
        rows.append((row, max(1, len(row) - len(completion))))
    return rows


@torch.no_grad()
def ending_losses(logits_fn: LogitsFn, tokenizer, examples: Sequence[HellaSwagExample], block_size: int,
                  device: torch.device) -> torch.Tensor:
    """The summed loss (minus the log-likelihood) of each ending of `examples`, in order, from one forward of
    all their rows (right-padded: a causal model's earlier positions do not see the padding)."""
    rows = [row for example in examples for row in _rows(tokenizer, example, block_size)]
    width = max(len(row) for row, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros((len(rows), width - 1))
    for r, (row, start) in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, start - 1:len(row) - 1] = 1  # the positions whose targets are the ending's tokens
    ids, mask = ids.to(device), mask.to(device)
    logits = logits_fn(ids[:, :-1]).float()
    losses = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(mask)
    return (losses * mask).sum(1).cpu()


def hellaswag(logits_fn: LogitsFn, tokenizer, examples: Sequence[HellaSwagExample], block_size: int,
              device: torch.device, batch_examples: int = 8) -> dict[str, float]:
    """Accuracy over `examples`, `batch_examples` of them per forward: the ending of lowest summed loss (`acc`)
    and of lowest loss per character (`acc_norm`)."""
    right_norm = right_sum = 0
    for first in range(0, len(examples), batch_examples):
        batch = examples[first:first + batch_examples]
        summed = ending_losses(logits_fn, tokenizer, batch, block_size, device)
        per_char = summed / torch.tensor([float(len(e)) for example in batch for e in example.endings])
        at = 0
        for example in batch:
            n = len(example.endings)
            right_sum += int(summed[at:at + n].argmin()) == example.label
            right_norm += int(per_char[at:at + n].argmin()) == example.label
            at += n
    return {"hellaswag/acc_norm": right_norm / len(examples), "hellaswag/acc": right_sum / len(examples),
            "hellaswag/examples": len(examples)}


# -- a saved model, evaluated ----------------------------------------------------------------------------------

@dataclass
class EvalModel:
    """A model read by minitrain/weights.py (a run's checkpoint, or Hugging Face weights), ready to evaluate."""

    model: GPT
    autocast: Callable[[], object]  # the run's precision's autocast context on this device
    weights: Weights

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.model(ids)

    def token_losses(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each prediction's loss, (B, T)."""
        return F.cross_entropy(self.logits(inputs).float().transpose(1, 2), targets, reduction="none")

    def data_config(self) -> Optional[DataConfig]:
        """The run's data config (None for Hugging Face weights, which name no corpus)."""
        run = self.weights.run
        return None if run is None else \
            OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), run.config["data"]))

    def tokenizer_source(self) -> Optional[str]:
        """What data.tokenizer names this model's tokenizer as: a run's pretrained name, or the run dir it saved its
        trained one in (None for a run that saved none); Hugging Face weights' own name or directory."""
        data = self.data_config()
        return data.tokenizer if data is not None and data.tokenizer != "train" else self.weights.tokenizer_source


def load_run(checkpoint: str, device: torch.device) -> EvalModel:
    """The model `checkpoint` names (a run dir, a checkpoint or Hugging Face weights: minitrain/weights.py) on
    `device`, in eval mode: in its run's precision, Hugging Face weights in their own dtype."""
    weights = open_weights(checkpoint, need_tokenizer=False)
    if weights.run is None:
        return EvalModel(weights.build(device), contextlib.nullcontext, weights)
    precision = resolve_precision(preset(weights.run.config["plan"]["precision"]), device)
    return EvalModel(weights.build(device, precision.param_dtype), lambda: precision.autocast(device.type), weights)


def _run_tokenizer(run: EvalModel, data: Optional[TokenData]):
    if run.weights.tokenizer is not None:
        return run.weights.tokenizer
    if data is None:
        raise DataError(f"{run.weights.run.run_dir} holds no {TOKENIZER} (saved by runs since 2026-12-03); evaluate "
                        "the run on its own data config, whose cache holds its tokenizer")
    return data.tokenizer


def _eval_data(run: EvalModel, data_cfg: Optional[DataConfig], progress: bool) -> TokenData:
    """The corpus to evaluate on, tokenized with the run's tokenizer: the run's own data config (its cache, when
    that still holds the run's tokenizer), or `data_cfg` prepared with the run's tokenizer."""
    block_size, source, own = run.model.cfg.block_size, run.tokenizer_source(), run.data_config()
    if data_cfg is None and own is None:
        raise DataError(f"{run.weights.tokenizer_source} is Hugging Face weights, which name no corpus: give the data "
                        "to evaluate on (data=NAME data.KEY=VALUE), or leave the validation loss out (--val-tokens 0)")
    if data_cfg is None:
        data = prepare_data(own, block_size, progress)
        if source is None or data.tokenizer.to_str() == _run_tokenizer(run, data).to_str():
            return data
        data_cfg = own  # its corpus changed since the run, and with it the trained tokenizer
    if source is None:
        raise DataError(f"{run.weights.run.run_dir} holds no {TOKENIZER} (saved by runs since 2026-12-03): another "
                        "corpus cannot be tokenized as this run was; evaluate it on its own data config")
    return prepare_data(replace(data_cfg, tokenizer=source), block_size, progress)


def evaluate_checkpoint(checkpoint: str, device: torch.device, data_cfg: Optional[DataConfig] = None,
                        val_tokens: Optional[int] = None, hellaswag_source: Optional[str] = None,
                        hellaswag_examples: Optional[int] = None, batch_size: int = 8,
                        progress: bool = True) -> dict[str, float]:
    """A checkpoint's (or Hugging Face weights') validation loss and perplexity on its run's data config or
    `data_cfg` (the first `val_tokens` of the split, default all; 0: none), and its HellaSwag accuracy with
    `hellaswag_source` (hub or a local jsonl); `batch_size` windows, or HellaSwag examples, per forward; a
    checkpoint's step. Deterministic: the same checkpoint gives the same numbers, and the batching adds no rounding
    of its own."""
    run = load_run(checkpoint, device)
    record: dict[str, float] = {"step": run.weights.run.step} if run.weights.run is not None else {}
    data = _eval_data(run, data_cfg, progress) if val_tokens != 0 else None
    if data is not None:
        record.update(validation_loss(run.token_losses, data.val, run.model.cfg.block_size, batch_size, device,
                                      val_tokens))
    if hellaswag_source is not None:
        examples = load_hellaswag(hellaswag_source, hellaswag_examples)
        record.update(hellaswag(run.logits, _run_tokenizer(run, data), examples, run.model.cfg.block_size, device,
                                batch_size))
    return record
