"""``postrl sft``: supervised fine-tuning with the run directory, checkpoints, resume, FSDP2 and Ray
paths of ``postrl train``.

The loss is the mean negative log-likelihood of the trained tokens over the mini-batch's token
count. It is the Train Worker's own loss with the ``reinforce`` policy loss at advantage 1 and
temperature 1 (``-log pi`` per token, ``token_mean`` aggregation), so the same worker, FSDP2 group
(gradients equal to one process) and Ray train actors run it, with nothing written twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from postrl.config.algorithm import AlgorithmConfig
from postrl.config.loading import save_config
from postrl.config.sft import SFTRunConfig
from postrl.config.training import TrainConfig
from postrl.data.sft import SFTExample, load_sft_examples
from postrl.models.host_memory import keep_freed_memory
from postrl.models.loading import load_tokenizer
from postrl.run.lifecycle import MiniBatchJob, RunSite, StepLoop, report_skipped, resume_point
from postrl.run.place import RunPlace, check_steps_left
from postrl.run.resolve import decay_settings, with_settings
from postrl.run.train_runner import make_sinks
from postrl.scheduling.base import Scheduler
from postrl.scheduling.factory import make_scheduler
from postrl.train.factory import PolicySpec
from postrl.types import Experience, ExperienceBatch, StepMetrics
from postrl.types.metric_names import (
    ACTOR_GRAD_NORM,
    ACTOR_LOSS,
    ACTOR_LR,
    ACTOR_SKIPPED_UPDATES,
    DATA_EPOCH,
    SFT_LOSS,
    SFT_PERPLEXITY,
    SFT_TOKENS,
    TIME_STEP_S,
)
from postrl.workers.roles import TrainWorker

# -log pi on the trained tokens: REINFORCE with every advantage 1 (the batch carries them, sft_batch)
SFT_ALGORITHM = AlgorithmConfig(advantage="unit", policy_loss="reinforce", loss_agg="token_mean", kl_beta=0.0)


def sft_batch(examples: list[SFTExample], pad_id: int) -> ExperienceBatch:
    """The examples as a batch the Train Worker trains on: advantage 1 on the trained tokens."""
    return ExperienceBatch.from_experiences(
        [
            Experience(
                e.prompt_ids,
                e.response_ids,
                [0.0] * len(e.response_ids),
                0.0,
                1.0,
                0,
                group_id=i,
                loss_mask=e.loss_mask,
            )
            for i, e in enumerate(examples)
        ],
        pad_id,
    )


def policy_spec(config: SFTRunConfig) -> PolicySpec:
    """The Train Worker of an SFT run: its ``train:`` section, one pass over each mini-batch."""
    train = TrainConfig.model_validate({**config.train.model_dump(), "epochs": 1})
    return PolicySpec(
        config.model.path,
        config.model.dtype,
        train,
        SFT_ALGORITHM,
        temperature=1.0,
        seed=config.seed,
        gradient_checkpointing=config.model.gradient_checkpointing,
        lora=config.model.lora,
    )


def make_trainer(config: SFTRunConfig) -> tuple[TrainWorker, Scheduler]:
    """(trainer, scheduler): a Train Worker in this process, an FSDP2 group of processes, or Ray actors."""
    scheduler = make_scheduler(config.scheduler, config.import_paths, roles=("train",))
    try:
        return scheduler.train_group(policy_spec(config)), scheduler
    except BaseException:
        scheduler.close()
        raise


def train_sft(
    config: SFTRunConfig, resume: bool = False, overwrite: bool = False, echo: Callable[[str], None] = print
) -> int:
    """Check, build, run; returns the steps done. Nothing is written before the data is checked."""
    keep_freed_memory()  # as postrl train's: an update's tensors reuse the blocks freed before them
    site = RunSite(config, "sft")
    done = site.check(resume, overwrite)
    tokenizer = load_tokenizer(config.model.path)
    d = config.data
    examples, skipped = load_sft_examples(
        d.train_files,
        tokenizer,
        d.prompt_column,
        d.response_column,
        d.messages_column,
        d.apply_chat_template,
        d.max_tokens,
        d.on_bad_row,
    )
    total = config.epochs * math.ceil(len(examples) / config.train.mini_batch_size)
    check_steps_left(total, done, f"epochs={config.epochs}")
    config = with_settings(config, decay_settings(config.train, total))
    trainer, scheduler = make_trainer(config)
    try:
        site.open(resume, overwrite, echo)
        return _run(config, site.place, trainer, tokenizer, examples, skipped, resume, total, echo)
    finally:
        try:
            trainer.close()
            scheduler.close()
        finally:
            site.close()


class SFTJob(MiniBatchJob):
    """``postrl sft`` as the step loop sees it: one optimizer step over a mini-batch of examples."""

    command = "sft"

    def __init__(
        self, config: SFTRunConfig, trainer: Any, tokenizer: Any, examples: list[SFTExample], step: int
    ) -> None:
        super().__init__(config, trainer, tokenizer, len(examples), step)
        self.examples = examples

    def step(self) -> StepMetrics:
        began, step = time.perf_counter(), self.step_count
        chosen = [self.examples[i] for i in self.chosen(len(self.examples))]
        self.updating = True
        metrics = self.trainer.update(sft_batch(chosen, self.tokenizer.pad_token_id))
        self.step_count = step + 1
        self.updating = False
        loss = metrics.get(ACTOR_LOSS)
        values = {
            SFT_LOSS: loss,
            SFT_PERPLEXITY: math.exp(min(loss, 50.0)),
            SFT_TOKENS: float(sum(sum(e.loss_mask) for e in chosen)),
            ACTOR_GRAD_NORM: metrics.get(ACTOR_GRAD_NORM),
            ACTOR_LR: metrics.get(ACTOR_LR),
            ACTOR_SKIPPED_UPDATES: float(metrics.skipped_steps),
            DATA_EPOCH: float(step // self.per_epoch),
            TIME_STEP_S: time.perf_counter() - began,
        }
        return StepMetrics(step=self.step_count, weight_version=self.step_count, values=values)


def _run(
    config: SFTRunConfig,
    place: RunPlace,
    trainer: Any,
    tokenizer: Any,
    examples: list[SFTExample],
    skipped: list[str],
    resume: bool,
    total: int,
    echo: Callable[[str], None],
) -> int:
    run_dir, step = config.run_dir, 0
    if resume:
        checkpoint, state = resume_point(place, echo)
        trainer.load_checkpoint(checkpoint)
        step = int(state["step"])
    save_config(config, run_dir / "config.yaml")
    place.publish("config.yaml")
    report_skipped(skipped, run_dir, echo)
    job = SFTJob(config, trainer, tokenizer, examples, step)
    loop = StepLoop(
        config,
        place,
        total,
        sinks=lambda out: make_sinks(config, run_dir, step if resume else None, out, total=total),
        published_at_end=("final_model", "metrics.jsonl", "tensorboard", "skipped_rows.txt"),
    )
    loop.run(job)
    return job.completed_steps
