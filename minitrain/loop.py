"""The training loop, top to bottom: a step; then, each at its cadence, a log record (with the divergence guard),
an evaluation, a checkpoint (the checkpointer says when); a stop request (Ctrl-C, SIGTERM) saves and ends the run;
an evaluation at or below trainer.target_loss ends it as its last step would; at the end a sample and the run's
records. Device values reach the host at log steps only.

It reads what it is given — the parts (minitrain/parts.py), the services it writes through, the settings — and calls
back into nothing that holds them: whoever made them owns them (minitrain/trainer.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from . import compile_check, distributed, memory, recompute
from .checkpointer import Checkpointer
from .config import TrainerConfig
from .distributed import Dist
from .evaluate import hellaswag, perplexity
from .generate import Sampler, Sampling
from .interrupts import Interrupts, TrainingInterrupted
from .logger import RunLogger
from .metrics import Throughput, memory_stats, peak_flops
from .parts import Parts
from .plan import Plan
from .rundir import MEMORY, SAMPLE, RunDir

# Steps of each process that tokens/s leaves out (metrics.Throughput): a compiled step compiles on its first
# call and warms up and records its CUDA graphs on the next two; any step's first run makes the allocator's
# first requests.
UNTIMED_STEPS_COMPILED, UNTIMED_STEPS_EAGER = 3, 1
# The key that marks the record of the evaluation that reached trainer.target_loss (its value: the target), the
# run's last: it tells a run that stopped at its target from one that stopped otherwise (scripts/bench_recipe.py).
TARGET_REACHED = "stop/target_loss"


@dataclass(frozen=True)
class Settings:
    """What the loop reads besides the parts: the plan, the trainer's cadences and counts, this process's place in
    the job, and whether it draws the progress bar."""

    plan: Plan
    trainer: TrainerConfig
    dist: Dist
    show_progress: bool = False


@dataclass(frozen=True)
class Services:
    """What the loop writes through: the run dir (its results, the command that continues it), the log, and the
    checkpointer, which says when it saves and guards against saving a diverged run."""

    run_dir: RunDir
    logger: RunLogger
    checkpointer: Checkpointer


def fit(parts: Parts, services: Services, settings: Settings) -> dict[str, Any]:
    """Train from the parts' progress to trainer.max_steps, or to the first evaluation at or below
    trainer.target_loss (a resumed run: the first after its checkpoint); returns the last logged record."""
    from tqdm.auto import tqdm

    t, plan, p = settings.trainer, settings.plan, parts.progress
    logger, checkpointer, run_dir = services.logger, services.checkpointer, services.run_dir
    if p.step >= t.max_steps:  # a finished run started again: its record (memory.json, sample) stays as it is
        return nothing_to_train(p.step, services, settings)
    meter, record, path, compared = announce(parts, services, settings), {}, None, False
    checking = plan.compiled and t.compile_check and plan.model.dropout == 0
    bar = tqdm(total=t.max_steps, initial=p.step, desc="train", unit="step", disable=not settings.show_progress,
               dynamic_ncols=True)
    try:
        with Interrupts(logger.print, settings.dist, plan.device) as interrupts:
            while p.step < t.max_steps:
                loss = checked_first_step(parts, logger, settings) if checking else parts.train_step(p.step)
                checking = False
                p.record(loss, parts.optimizer.stats()["skipped_steps"])
                meter.step()
                bar.update(1)
                logging, evaluating = (p.step % every == 0 or p.step == t.max_steps
                                       for every in (t.log_every, t.eval_every))
                logging |= evaluating and t.target_loss is not None  # a step the run may end at logs as its last
                if logging:
                    checkpointer.guard()  # once this step: a save below does not read the device again
                    record = log_record(parts, meter, settings)
                    if not compared and plan.device.type == "cuda":
                        logger.print(memory_comparison(plan))
                        compared = True
                if evaluating:
                    record = {**(record if logging else {"step": p.step}), **eval_record(parts, settings)}
                reached = evaluating and reached_target(record, t)
                if logging or evaluating:
                    logger.log(record)
                    bar.set_postfix(loss=f"{record.get('train/loss', float('nan')):.3f}")
                stop = interrupts.agreed(logging)
                saving = checkpointer.due(p.step, ending=stop or reached)
                if saving:
                    path = checkpointer.save()
                if reached:
                    break
                if stop:
                    raise TrainingInterrupted(
                        f"stopped at step {p.step} of {t.max_steps}; " + (
                            f"checkpoint saved to {path} — continue with: "
                            f"{run_dir.continue_command(settings.dist.enabled)}" if checkpointer.saves else
                            "no checkpoint saved (trainer.save_every=0)"),
                        main=settings.dist.is_main, exit_code=interrupts.exit_code)
                if logging or evaluating or saving:
                    meter.restart()  # eval and saving are not training time
        bar.close()
        return finish(parts, services, settings, record, path)
    except BaseException as e:
        bar.close()
        logger.finish(exit_code=e.exit_code if isinstance(e, TrainingInterrupted) else
                      130 if isinstance(e, KeyboardInterrupt) else 1)
        raise


def announce(parts: Parts, services: Services, settings: Settings) -> Throughput:
    """The lines before the first step; the meter of tokens/s that starts with it."""
    logger, run_dir, plan = services.logger, services.run_dir, settings.plan
    logger.print(f"minitrain: {plan.model.name} ({parts.model.num_params() / 1e6:.2f}M params) | "
                 f"run dir {run_dir.path}")
    logger.print(plan.memory.table())
    logger.summary(plan.memory.as_dict())
    meter = throughput(parts, settings)
    if plan.compiled:  # a big model's compile takes minutes, with the bar standing at its first step
        logger.print(f"compiling: the first {meter.untimed_steps} steps build the compiled step"
                     f"{' and record its CUDA graphs' if plan.cuda_graphs else ''}; tokens/s leaves them out")
    return meter


def checked_first_step(parts: Parts, logger: RunLogger, settings: Settings) -> torch.Tensor:
    """This process's first compiled step, its loss checked against the uncompiled forward's on the same params
    and batch (computed first)."""
    plan, dist, step = settings.plan, settings.dist, parts.progress.step
    expected = compile_check.eager_loss(parts.eager_forward_loss, parts.train_batches, step, plan.grad_accum, dist)
    loss = parts.train_step(step)
    setting = f"{plan.model.name}, precision={plan.precision.name}, torch.compile mode={plan.compile_mode}"
    logger.print(compile_check.verify(loss, expected, dist, setting))
    return loss


def throughput(parts: Parts, settings: Settings) -> Throughput:
    """A meter of this run's tokens/s, MFU and HFU (recompute counted) over all devices' peak, from the
    first step after this process's warm-up ones."""
    plan = settings.plan
    T = plan.model.block_size
    peak = settings.trainer.peak_flops or peak_flops(plan.device, plan.precision.mfu_dtype)
    model_flops = parts.model.flops_per_token(T)
    extra = recompute.recompute_flops_per_token(plan.model, plan.checkpointing, T)
    sync = (lambda: torch.cuda.synchronize(plan.device)) if plan.device.type == "cuda" else (lambda: None)
    return Throughput(plan.batch_size * T, model_flops, model_flops + extra,
                      peak and peak * settings.dist.world_size,  # global tokens/s over all devices' peak
                      untimed_steps=UNTIMED_STEPS_COMPILED if plan.compiled else UNTIMED_STEPS_EAGER, sync=sync)


def log_record(parts: Parts, meter: Throughput, settings: Settings) -> dict[str, Any]:
    """The log step's record: losses over all ranks, the optimizer's counters, speed and memory."""
    stats, plan, dist = parts.optimizer.stats(), settings.plan, settings.dist
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
def evaluate(parts: Parts, settings: Settings) -> float:
    """The mean validation loss of trainer.eval_batches global batches, over all ranks."""
    parts.model.eval()
    rank, world = settings.dist.rank, settings.dist.world_size
    # clone: under CUDA graphs a call's output lives in memory that the next call's replay overwrites
    losses = torch.stack([parts.forward_loss(*parts.val_batches.get(i, rank, world)).float().clone()
                          for i in range(settings.trainer.eval_batches)])
    parts.model.train()
    return distributed.mean(losses.mean(), settings.dist).item()


def eval_record(parts: Parts, settings: Settings) -> dict[str, Any]:
    """What an eval step logs: the validation loss (trainer.eval_batches random windows) and its perplexity, and
    with trainer.eval_hellaswag the HellaSwag accuracy (every rank scores every example: under fsdp each forward
    is collective)."""
    loss = evaluate(parts, settings)
    record = {"val/loss": loss, "val/ppl": perplexity(loss)}
    if parts.hellaswag is not None:
        plan, tokenizer = settings.plan, parts.data.tokenizer
        parts.model.eval()
        with plan.precision.autocast(plan.device.type):
            record.update(hellaswag(parts.model, tokenizer, parts.hellaswag, plan.model.block_size,
                                    plan.device))
        parts.model.train()
    return record


def reached_target(record: dict[str, Any], t: TrainerConfig) -> bool:
    """Whether an evaluation's validation loss is at or below trainer.target_loss (a NaN one never is); if so, its
    record says so (TARGET_REACHED)."""
    if t.target_loss is None or not record["val/loss"] <= t.target_loss:
        return False
    record[TARGET_REACHED] = t.target_loss
    return True


def memory_comparison(plan: Plan) -> str:
    s = torch.cuda.memory_stats(plan.device)
    return memory.compare(plan.memory, s["allocated_bytes.all.peak"], s["reserved_bytes.all.peak"],
                          cuda_graphs=plan.cuda_graphs)


def finish(parts: Parts, services: Services, settings: Settings, record: dict[str, Any],
           checkpoint: Optional[Path]) -> dict[str, Any]:
    """The run's end: why it ends before trainer.max_steps (its target reached), memory.json (the predicted terms
    beside the measured peaks, which scripts/report.py reads per sweep cell), a sample, the last console line saying
    where the results are."""
    logger, run_dir, plan = services.logger, services.run_dir, settings.plan
    if TARGET_REACHED in record:
        logger.print(f"target reached: validation loss {record['val/loss']:.4f} <= trainer.target_loss="
                     f"{record[TARGET_REACHED]!r} at step {record['step']} of {settings.trainer.max_steps}; the run "
                     "ends here")
    measured = {k: v for k, v in record.items() if k.startswith("mem/")}
    run_dir.write(MEMORY, json.dumps({**plan.memory.as_dict(), **measured}, indent=1))
    record["sample"] = sample(parts, services, settings)
    losses = ", ".join(f"{label} {record[key]:.4f}" for key, label in (("train/loss", "loss"), ("val/loss", "val"))
                       if record.get(key) is not None)
    logger.print(f"finished: step {parts.progress.step} of {settings.trainer.max_steps}, {losses} | checkpoint "
                 f"{checkpoint} | metrics {run_dir.path / 'metrics.jsonl'}")
    logger.summary({k: v for k, v in record.items() if k != "step"})
    logger.finish()
    return record


def nothing_to_train(step: int, services: Services, settings: Settings) -> dict[str, Any]:
    """A resumed run already at (or past) trainer.max_steps: say so instead of running no step in silence."""
    logger, run_dir = services.logger, services.run_dir
    logger.print(f"nothing to train: the checkpoint is at step {step} and trainer.max_steps="
                 f"{settings.trainer.max_steps}; raise trainer.max_steps to train further (this run's files in "
                 f"{run_dir.path} are left as they were)")
    logger.finish()
    return {"step": step}


def sample(parts: Parts, services: Services, settings: Settings) -> str:
    """A short continuation of a fixed prompt (at most what fits model.block_size): a human-readable check of
    what the model learned. Without the KV cache: the training model may be sharded, or its blocks' forwards
    swapped by a recompute policy, and a short sample costs little."""
    plan, data, t, logger, run_dir = settings.plan, parts.data, settings.trainer, services.logger, services.run_dir
    ids = torch.tensor([data.tokenizer.encode("def ").ids], device=plan.device)
    n = min(t.sample_tokens, plan.model.block_size - ids.shape[1])
    if n <= 0:
        return ""
    sampling = Sampling(temperature=0.8, top_k=50, vocab=data.vocab_size)
    parts.model.eval()
    with plan.precision.autocast(plan.device.type):  # on every rank: under fsdp each forward all-gathers
        sampler = Sampler(parts.model, 1, ids.shape[1] + n, sampling, kv_cache=False)
        out = sampler.generate(ids, n, seed=t.seed)
    parts.model.train()
    text = data.decode(out.tokens[0].tolist())
    run_dir.write(SAMPLE, text)
    logger.print(f"sample:\n{text}")
    return text
