"""``postrl dpo``: validate, cache the reference log-probabilities once, train over the pairs,
checkpoint, resume, save the final model. Shares the run directory handling, the lease, the
metric sinks, the checkpoints, the graceful stop and the final model with ``postrl train``
(:class:`~postrl.run.lifecycle.StepLoop`)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from postrl.config.dpo import DPORunConfig
from postrl.config.loading import save_config
from postrl.data.preferences import load_preference_pairs
from postrl.models.host_memory import keep_freed_memory
from postrl.models.loading import load_tokenizer
from postrl.run.lifecycle import MiniBatchJob, RunSite, StepLoop, report_skipped, resume_point
from postrl.run.place import RunPlace, check_steps_left
from postrl.run.resolve import decay_settings, with_settings
from postrl.run.train_runner import make_sinks
from postrl.scheduling.base import Scheduler
from postrl.scheduling.factory import make_scheduler
from postrl.train.dpo import PreferenceSpec
from postrl.types import PreferencePair, StepMetrics
from postrl.types.metric_names import DATA_EPOCH, TIME_STEP_S
from postrl.workers.roles import PreferenceTrainer

REFERENCE_FILE = "reference_logprobs.pt"


def reference_logprobs(
    config: DPORunConfig, pairs: list[PreferencePair], pad_id: int, run_dir: Path, scheduler: Scheduler
) -> torch.Tensor:
    """The starting model's (chosen, rejected) log-probabilities, computed once per run by a worker
    the scheduler places (then closed) and cached in the run directory (a resumed run reads them
    back: its policy is no longer the reference)."""
    path = run_dir / REFERENCE_FILE
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        if cached["sources"] == [p.source for p in pairs]:
            return cached["logprobs"]
    reference = scheduler.preference_trainer(PreferenceSpec.of_run(config, pad_id).reference())
    try:
        logprobs = reference.reference_logprobs(pairs)
    finally:
        reference.close()
    torch.save({"sources": [p.source for p in pairs], "logprobs": logprobs}, path)
    return logprobs


def train_dpo(config: DPORunConfig, resume: bool = False, overwrite: bool = False, echo=print) -> int:
    """Check, place the trainer, run; returns the steps done."""
    keep_freed_memory()  # as postrl train's: an update's tensors reuse the blocks freed before them
    site = RunSite(config, "dpo")
    done = site.check(resume, overwrite)
    tokenizer = load_tokenizer(config.model.path)
    pairs, skipped = load_preference_pairs(
        config.data.train_files,
        tokenizer,
        config.data.max_tokens,
        config.data.on_bad_row,
        config.data.apply_chat_template,
    )
    total = config.epochs * math.ceil(len(pairs) / config.train.mini_batch_size)
    check_steps_left(total, done, f"epochs={config.epochs}")
    config = with_settings(config, decay_settings(config.train, total))
    site.open(resume, overwrite, echo)
    try:
        return _train(config, site.place, tokenizer, pairs, skipped, resume, total, echo)
    finally:
        site.close()


class DPOJob(MiniBatchJob):
    """``postrl dpo`` as the step loop sees it: one optimizer step over a mini-batch of pairs."""

    command = "dpo"

    def __init__(self, config: DPORunConfig, worker: PreferenceTrainer, tokenizer, pairs, reference, step: int) -> None:
        super().__init__(config, worker, tokenizer, len(pairs), step)
        self.pairs = pairs
        self.reference = reference

    def step(self) -> StepMetrics:
        began, step = time.perf_counter(), self.step_count
        chosen = self.chosen(len(self.pairs))
        self.updating = True
        values = self.trainer.update_pairs([self.pairs[i] for i in chosen], self.reference[chosen])
        self.step_count = step + 1
        self.updating = False
        values.update({DATA_EPOCH: float(step // self.per_epoch), TIME_STEP_S: time.perf_counter() - began})
        return StepMetrics(step=self.step_count, weight_version=self.step_count, values=values)


def _train(config: DPORunConfig, place: RunPlace, tokenizer, pairs, skipped, resume: bool, total: int, echo) -> int:
    report_skipped(skipped, config.run_dir, echo)
    scheduler = make_scheduler(config.scheduler, [], roles=("train",))  # DPO imports no plugins
    try:
        reference = reference_logprobs(config, pairs, tokenizer.pad_token_id, config.run_dir, scheduler)
        worker = scheduler.preference_trainer(PreferenceSpec.of_run(config, tokenizer.pad_token_id))
        try:
            return _loop(config, place, tokenizer, pairs, reference, worker, resume, total, echo)
        finally:
            worker.close()
    finally:
        scheduler.close()


def _loop(
    config: DPORunConfig,
    place: RunPlace,
    tokenizer,
    pairs,
    reference: torch.Tensor,
    worker: PreferenceTrainer,
    resume: bool,
    total: int,
    echo,
) -> int:
    """The steps over the pairs from the start (or the checkpoint); the steps done."""
    run_dir = config.run_dir
    step = 0
    if resume:
        checkpoint, state = resume_point(place, echo)
        worker.load_checkpoint(checkpoint)
        step = int(state["step"])
    save_config(config, run_dir / "config.yaml")
    place.publish("config.yaml")
    loop = StepLoop(
        config,
        place,
        total,
        sinks=lambda out: make_sinks(config, run_dir, step if resume else None, out, total=total),
        published_at_end=("final_model", "metrics.jsonl", "tensorboard", REFERENCE_FILE, "skipped_rows.txt"),
    )
    job = DPOJob(config, worker, tokenizer, pairs, reference, step)
    loop.run(job)
    return job.completed_steps
