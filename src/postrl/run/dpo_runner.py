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
from postrl.data.preferences import PreferencePair, load_preference_pairs
from postrl.models.devices import resolve_device
from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.run.lifecycle import MiniBatchJob, RunSite, StepLoop, report_skipped, resume_point
from postrl.run.place import RunPlace, check_steps_left
from postrl.run.resolve import decay_settings, with_settings
from postrl.run.train_runner import make_sinks
from postrl.train.dpo import DPOWorker
from postrl.train.lora import apply_lora
from postrl.types import StepMetrics
from postrl.types.metric_names import DATA_EPOCH, TIME_STEP_S

REFERENCE_FILE = "reference_logprobs.pt"


def reference_logprobs(config: DPORunConfig, pairs: list[PreferencePair], pad_id: int, run_dir: Path) -> torch.Tensor:
    """The starting model's (chosen, rejected) log-probabilities, computed once per run and cached in
    the run directory (a resumed run reads them back: its policy is no longer the reference)."""
    path = run_dir / REFERENCE_FILE
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        if cached["sources"] == [p.source for p in pairs]:
            return cached["logprobs"]
    device = resolve_device(config.train.device, "train.device")
    reference = load_causal_lm(config.model.path, config.model.dtype).to(device)
    worker = DPOWorker(reference, config.train, config.dpo, pad_id)
    logprobs = worker.reference_logprobs(pairs)
    torch.save({"sources": [p.source for p in pairs], "logprobs": logprobs}, path)
    return logprobs


def train_dpo(config: DPORunConfig, resume: bool = False, overwrite: bool = False, echo=print) -> DPOWorker:
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

    def __init__(self, config: DPORunConfig, worker: DPOWorker, tokenizer, pairs, reference, step: int) -> None:
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


def _train(
    config: DPORunConfig, place: RunPlace, tokenizer, pairs, skipped, resume: bool, total: int, echo
) -> DPOWorker:
    run_dir = config.run_dir
    report_skipped(skipped, run_dir, echo)
    reference = reference_logprobs(config, pairs, tokenizer.pad_token_id, run_dir)
    device = resolve_device(config.train.device, "train.device")
    model = load_causal_lm(config.model.path, config.model.dtype).to(device)
    if config.model.lora is not None:
        model = apply_lora(model, config.model.lora)
    worker = DPOWorker(
        model, config.train, config.dpo, tokenizer.pad_token_id, config.model.gradient_checkpointing, config.model.lora
    )
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
    loop.run(DPOJob(config, worker, tokenizer, pairs, reference, step))
    return worker
