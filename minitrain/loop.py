"""The training loop, top to bottom: a step; then, each at its cadence, the divergence check and a log record, an
evaluation, a checkpoint; a stop request (Ctrl-C, SIGTERM) saves and ends the run; at the end a sample and the
run's records. Device values reach the host at log steps only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from . import compile_check, distributed, divergence, files, memory, recompute
from .config import Config
from .data import TokenData
from .distributed import Dist
from .divergence import Kept
from .evaluate import hellaswag, perplexity
from .generate import Sampler, Sampling
from .interrupts import Interrupts, TrainingInterrupted
from .logger import RunLogger
from .metrics import Throughput, memory_stats, peak_flops
from .parts import Parts
from .plan import Plan
from .rundir import RunInfo

# Steps of each process that tokens/s leaves out (metrics.Throughput): a compiled step compiles on its first
# call and warms up and records its CUDA graphs on the next two; any step's first run makes the allocator's
# first requests.
UNTIMED_STEPS_COMPILED, UNTIMED_STEPS_EAGER = 3, 1


class Run(Protocol):
    """What the loop needs besides the parts (minitrain.trainer.Trainer)."""

    cfg: Config
    plan: Plan
    dist: Dist
    out_dir: Path
    data: TokenData
    logger: RunLogger
    run: RunInfo
    kept: Optional[Kept]
    show_progress: bool

    def save(self) -> Path: ...

    def close(self) -> None: ...


def fit(parts: Parts, run: Run) -> dict[str, Any]:
    """Train from the parts' progress to trainer.max_steps; returns the last logged record."""
    from tqdm.auto import tqdm

    t, p = run.cfg.trainer, parts.progress
    if p.step >= t.max_steps:  # a finished run started again: its record (memory.json, sample) stays as it is
        return nothing_to_train(p.step, run)
    meter, record, path, compared = announce(parts, run), {}, None, False
    checking = run.plan.compiled and t.compile_check and run.plan.model.dropout == 0
    bar = tqdm(total=t.max_steps, initial=p.step, desc="train", unit="step", disable=not run.show_progress,
               dynamic_ncols=True)
    try:
        with Interrupts(run.logger.print, run.dist, run.plan.device) as interrupts:
            while p.step < t.max_steps:
                loss = checked_first_step(parts, run) if checking else parts.train_step(p.step)
                checking = False
                p.record(loss, parts.optimizer.stats()["skipped_steps"])
                meter.step()
                bar.update(1)
                logging, evaluating, saving = (p.step % every == 0 or p.step == t.max_steps
                                               for every in (t.log_every, t.eval_every, t.save_every))
                if logging:
                    divergence.check(p, run.plan, run.dist, run.kept, t)
                    record = log_record(parts, run, meter)
                    if not compared and run.plan.device.type == "cuda":
                        run.logger.print(memory_comparison(run.plan))
                        compared = True
                if evaluating:
                    record = {**(record if logging else {"step": p.step}), **eval_record(parts, run)}
                if logging or evaluating:
                    run.logger.log(record)
                    bar.set_postfix(loss=f"{record.get('train/loss', float('nan')):.3f}")
                stop = interrupts.agreed(logging)
                if saving or stop:
                    path = run.save()
                if stop:
                    raise TrainingInterrupted(
                        f"stopped at step {p.step} of {t.max_steps}; checkpoint saved to {path} — continue "
                        f"with: {run.run.continue_command(run.out_dir, run.dist.enabled)}",
                        main=run.dist.is_main, exit_code=interrupts.exit_code)
                if logging or evaluating or saving:
                    meter.restart()  # eval and saving are not training time
        bar.close()
        return finish(parts, run, record, path)
    except BaseException as e:
        bar.close()
        run.logger.finish(exit_code=e.exit_code if isinstance(e, TrainingInterrupted) else
                          130 if isinstance(e, KeyboardInterrupt) else 1)
        raise
    finally:
        run.close()  # the run dir is free for the next run (a resume in this process included)


def announce(parts: Parts, run: Run) -> Throughput:
    """The lines before the first step; the meter of tokens/s that starts with it."""
    run.logger.print(f"minitrain: {run.plan.model.name} ({parts.model.num_params() / 1e6:.2f}M params) | "
                     f"run dir {run.out_dir}")
    run.logger.print(run.plan.memory.table())
    run.logger.summary(run.plan.memory.as_dict())
    meter = throughput(parts, run)
    if run.plan.compiled:  # a big model's compile takes minutes, with the bar standing at its first step
        run.logger.print(f"compiling: the first {meter.untimed_steps} steps build the compiled step"
                         f"{' and record its CUDA graphs' if run.plan.cuda_graphs else ''}; tokens/s leaves them out")
    return meter


def checked_first_step(parts: Parts, run: Run) -> torch.Tensor:
    """This process's first compiled step, its loss checked against the uncompiled forward's on the same params
    and batch (computed first)."""
    plan, step = run.plan, parts.progress.step
    expected = compile_check.eager_loss(parts.eager_forward_loss, parts.train_batches, step, plan.grad_accum,
                                        run.dist)
    loss = parts.train_step(step)
    setting = f"{plan.model.name}, precision={plan.precision.name}, torch.compile mode={plan.compile_mode}"
    run.logger.print(compile_check.verify(loss, expected, run.dist, setting))
    return loss


def throughput(parts: Parts, run: Run) -> Throughput:
    """A meter of this run's tokens/s, MFU and HFU (recompute counted) over all devices' peak, from the
    first step after this process's warm-up ones."""
    plan, T = run.plan, run.plan.model.block_size
    peak = run.cfg.trainer.peak_flops or peak_flops(plan.device, plan.precision.mfu_dtype)
    model_flops = parts.model.flops_per_token(T)
    extra = recompute.recompute_flops_per_token(plan.model, plan.checkpointing, T)
    sync = (lambda: torch.cuda.synchronize(plan.device)) if plan.device.type == "cuda" else (lambda: None)
    return Throughput(plan.batch_size * T, model_flops, model_flops + extra,
                      peak and peak * run.dist.world_size,  # global tokens/s over all devices' peak
                      untimed_steps=UNTIMED_STEPS_COMPILED if plan.compiled else UNTIMED_STEPS_EAGER, sync=sync)


def log_record(parts: Parts, run: Run, meter: Throughput) -> dict[str, Any]:
    """The log step's record: losses over all ranks, the optimizer's counters, speed and memory."""
    stats, plan, dist = parts.optimizer.stats(), run.plan, run.dist
    loss = distributed.mean(parts.progress.take_mean_loss(), dist)
    step = parts.progress.step
    record = {"step": step, "tokens": step * plan.batch_size * plan.model.block_size,
              "train/loss": loss.item(), "opt/lr": plan.schedule(step - 1),
              "opt/grad_norm": float(stats["grad_norm"]), "amp/skipped_steps": float(stats["skipped_steps"])}
    if "loss_scale" in stats:  # dynamic loss scaling (fp16) only: without it there is no scale to show
        record["amp/loss_scale"] = float(stats["loss_scale"])
    record.update(meter.read())
    record.update(memory_stats(plan.device))
    if dist.enabled:  # every rank's peak: under fsdp they should match, under imbalance they do not
        key = "mem/peak_allocated_gb" if plan.device.type == "cuda" else "mem/peak_rss_gb"
        for rank, value in enumerate(distributed.gather(record[key], dist)):
            record[f"mem/rank{rank}/{key[4:]}"] = value
    return record


@torch.no_grad()
def evaluate(parts: Parts, run: Run) -> float:
    """The mean validation loss of trainer.eval_batches global batches, over all ranks."""
    parts.model.eval()
    rank, world = run.dist.rank, run.dist.world_size
    # clone: under CUDA graphs a call's output lives in memory that the next call's replay overwrites
    losses = torch.stack([parts.forward_loss(*parts.val_batches.get(i, rank, world)).float().clone()
                          for i in range(run.cfg.trainer.eval_batches)])
    parts.model.train()
    return distributed.mean(losses.mean(), run.dist).item()


def eval_record(parts: Parts, run: Run) -> dict[str, Any]:
    """What an eval step logs: the validation loss (trainer.eval_batches random windows) and its perplexity, and
    with trainer.eval_hellaswag the HellaSwag accuracy (every rank scores every example: under fsdp each forward
    is collective)."""
    loss = evaluate(parts, run)
    record = {"val/loss": loss, "val/ppl": perplexity(loss)}
    if parts.hellaswag is not None:
        plan = run.plan
        parts.model.eval()
        with plan.precision.autocast(plan.device.type):
            record.update(hellaswag(parts.model, run.data.tokenizer, parts.hellaswag, plan.model.block_size,
                                    plan.device))
        parts.model.train()
    return record


def memory_comparison(plan: Plan) -> str:
    s = torch.cuda.memory_stats(plan.device)
    return memory.compare(plan.memory, s["allocated_bytes.all.peak"], s["reserved_bytes.all.peak"],
                          cuda_graphs=plan.cuda_graphs)


def finish(parts: Parts, run: Run, record: dict[str, Any], checkpoint: Optional[Path]) -> dict[str, Any]:
    """The run's end: memory.json (the predicted terms beside the measured peaks, which scripts/report.py reads
    per sweep cell), a sample, the last console line saying where the results are."""
    if run.dist.is_main:
        measured = {k: v for k, v in record.items() if k.startswith("mem/")}
        files.atomic_write(run.out_dir / "memory.json", json.dumps({**run.plan.memory.as_dict(), **measured}, indent=1))
    record["sample"] = sample(parts, run)
    losses = ", ".join(f"{label} {record[key]:.4f}" for key, label in (("train/loss", "loss"), ("val/loss", "val"))
                       if record.get(key) is not None)
    run.logger.print(f"finished: step {parts.progress.step} of {run.cfg.trainer.max_steps}, {losses} | checkpoint "
                     f"{checkpoint} | metrics {run.out_dir / 'metrics.jsonl'}")
    run.logger.summary({k: v for k, v in record.items() if k != "step"})
    run.logger.finish()
    return record


def nothing_to_train(step: int, run: Run) -> dict[str, Any]:
    """A resumed run already at (or past) trainer.max_steps: say so instead of running no step in silence."""
    run.logger.print(f"nothing to train: the checkpoint is at step {step} and trainer.max_steps="
                     f"{run.cfg.trainer.max_steps}; raise trainer.max_steps to train further (this run's files in "
                     f"{run.out_dir} are left as they were)")
    run.logger.finish()
    run.close()
    return {"step": step}


def sample(parts: Parts, run: Run) -> str:
    """A short continuation of a fixed prompt (at most what fits model.block_size): a human-readable check of
    what the model learned. Without the KV cache: the training model may be sharded, or its blocks' forwards
    swapped by a recompute policy, and a short sample costs little."""
    plan, data = run.plan, run.data
    ids = torch.tensor([data.tokenizer.encode("def ").ids], device=plan.device)
    n = min(run.cfg.trainer.sample_tokens, plan.model.block_size - ids.shape[1])
    if n <= 0:
        return ""
    sampling = Sampling(temperature=0.8, top_k=50, vocab=data.vocab_size)
    parts.model.eval()
    with plan.precision.autocast(plan.device.type):  # on every rank: under fsdp each forward all-gathers
        sampler = Sampler(parts.model, 1, ids.shape[1] + n, sampling, kv_cache=False)
        out = sampler.generate(ids, n, seed=run.cfg.trainer.seed)
    parts.model.train()
    text = data.decode(out.tokens[0].tolist())
    if run.dist.is_main:
        files.atomic_write(run.out_dir / "sample.txt", text)
    run.logger.print(f"sample:\n{text}")
    return text
