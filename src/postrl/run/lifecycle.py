"""The step loop every training command shares (``postrl train``, ``dpo``, ``sft``): steps until
the last one or a stop request, metrics to the sinks, checkpoints every ``checkpoint.every_steps``
and on a stop, a clear message with the resume command, and the final model at the end.

A first Ctrl-C (or SIGTERM) stops after the step in progress; a second abandons it, and a job whose
step had not yet changed the weights is put back to its last completed step.
"""

from __future__ import annotations

import math
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from postrl.run.checkpoint import latest_checkpoint
from postrl.run.interrupt import GracefulStop, RunInterrupted, StepAbandoned
from postrl.run.lease import RunLease
from postrl.run.metrics import MetricSink
from postrl.run.place import RunPlace
from postrl.run.progress import shown_on_console
from postrl.types import StepMetrics


class SteppedJob(Protocol):
    """A training job the loop drives one step at a time."""

    command: str  # the CLI command, for the resume message

    @property
    def completed_steps(self) -> int: ...

    def step(self) -> StepMetrics: ...

    def checkpoint(self) -> Path:
        """Write a complete checkpoint of the last completed step; its folder."""
        ...

    def restore_abandoned_step(self) -> bool:
        """After an abandoned step, back to the last completed one; False when the weights had changed."""
        ...

    def save_final(self, folder: Path) -> None:
        """The trained model (and tokenizer) as a loadable folder."""
        ...


class RunSite:
    """The run directory and its lease, the same for every training command: checked before any
    work (:meth:`check`), opened once the job is built (:meth:`open`: the old run moved aside with
    ``--overwrite``, the directory prepared, the lease taken), released at the end (:meth:`close`)."""

    def __init__(self, config: Any, command: str) -> None:
        self.place = RunPlace(config)
        self.command = command
        self.lease = RunLease(self.place.location)

    def check(self, resume: bool, overwrite: bool) -> int:
        """No live controller holds the run; a resume has a completed step (returned), a new run a
        free directory (0)."""
        self.lease.check_free()
        if resume:
            return self.place.check_resumable()
        self.place.check_new(overwrite, command=self.command)
        return 0

    def open(self, resume: bool, overwrite: bool, echo: Callable[[str], None]) -> None:
        if not resume and overwrite:
            aside = self.place.move_aside()
            if aside is not None:
                echo(f"moved the previous run in {self.place.location} to {aside}")
        if self.place.reused:
            echo(f"reusing {self.place.location}: it held only the leftovers of a launch that completed no step")
        self.place.prepare(resume)
        self.lease.acquire(echo)

    def close(self) -> None:
        self.lease.release()


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The order of a data set's ``count`` items in ``epoch``: seeded, so a resumed run continues it."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def report_skipped(skipped: list[str], run_dir: Path, echo: Callable[[str], None], shown: int = 10) -> None:
    """Print the rows ``data.on_bad_row=skip`` left out (file:line and why), the first ``shown`` of
    them, and list them all in ``skipped_rows.txt``."""
    if not skipped:
        return
    (run_dir / "skipped_rows.txt").write_text("".join(line + "\n" for line in skipped))
    echo(f"skipped {len(skipped)} bad rows (data.on_bad_row=skip):")
    for line in skipped[:shown]:
        echo(f"  {line}")
    if len(skipped) > shown:
        echo(f"  ... and {len(skipped) - shown} more, all listed in {run_dir / 'skipped_rows.txt'}")


def resume_point(place: RunPlace, echo: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    """The latest complete checkpoint of a run being resumed, and the run state saved with it."""
    from postrl.run.checkpoint import load_run_state

    checkpoint = latest_checkpoint(place.local)
    if checkpoint is None:
        raise FileNotFoundError(f"no complete checkpoint under {place.location}/checkpoints to resume from")
    state = load_run_state(checkpoint)
    echo(f"resumed {place.location} from step {int(state['step'])} ({checkpoint})")
    return checkpoint, state


class MiniBatchJob:
    """What ``postrl dpo`` and ``postrl sft`` share: one optimizer step of a trainer per step over
    a mini-batch of the run's examples; checkpoints hold the trainer and the step; a step abandoned
    before the trainer was called is undone (none of its work changed the weights)."""

    command: str  # the CLI command (sft, dpo), for the resume message

    def __init__(self, config: Any, trainer: Any, tokenizer: Any, count: int, step: int) -> None:
        self.config = config
        self.trainer = trainer
        self.tokenizer = tokenizer
        self.step_count = step
        self.per_epoch = math.ceil(count / config.train.mini_batch_size)
        self.updating = False  # True while the trainer is changing the weights

    @property
    def completed_steps(self) -> int:
        return self.step_count

    def chosen(self, count: int) -> list[int]:
        """This step's example indices: its slice of its epoch's seeded order."""
        step, mini = self.step_count, self.config.train.mini_batch_size
        ranked = epoch_order(count, self.config.seed, step // self.per_epoch)
        return ranked[(step % self.per_epoch) * mini : (step % self.per_epoch + 1) * mini]

    def restore_abandoned_step(self) -> bool:
        return not self.updating

    def checkpoint(self) -> Path:
        from postrl.run.checkpoint import save_checkpoint

        state = {"step": self.step_count, "weight_version": self.step_count}
        c = self.config
        return save_checkpoint(c.run_dir, self.step_count, self.trainer, state, c.checkpoint.keep_last, self.tokenizer)

    def save_final(self, folder: Path) -> None:
        self.trainer.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)


def stopped_message(location: str, step: int, saved_at: int | None, command: str, abandoned: bool = False) -> str:
    what = "abandoned a step that had started updating the weights; " if abandoned else ""
    if saved_at:
        return (
            f"stopped after step {step}; {what}the last checkpoint is step {saved_at}. "
            f"Resume with: postrl {command} --resume {location}"
        )
    return f"stopped after step {step}; {what}no checkpoint was written, so there is nothing to resume"


def stderr_echo(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class StepLoop:
    """``run(job)``: the loop; ``observers`` see each step's metrics before the sinks do (validation,
    watches) and may add to them; ``published_at_end`` are the run-directory entries published last."""

    def __init__(
        self,
        config: Any,
        place: RunPlace,
        total: int,
        sinks: Callable[[Callable[[str], None]], list[MetricSink]],
        observers: Sequence[Callable[[StepMetrics], None]] = (),
        published_at_end: Sequence[str] = ("final_model", "metrics.jsonl", "tensorboard"),
        at_end: Callable[[], str | None] | None = None,
    ) -> None:
        self.config = config
        self.place = place
        self.total = total
        self.make_sinks = sinks
        self.observers = list(observers)
        self.published_at_end = published_at_end
        self.at_end = at_end

    def run(self, job: SteppedJob) -> None:
        show_bar = self.config.logging.progress_bar and sys.stderr.isatty()
        bar = tqdm(
            total=self.total,
            initial=job.completed_steps,
            disable=not show_bar,
            desc=self.config.name,
            unit="step",
            leave=False,
        )
        echo = bar.write if show_bar else stderr_echo
        sinks = self.make_sinks(bar.write if show_bar else print)
        stopper = GracefulStop(echo=echo)
        shown = shown_on_console(self.config.logging.progress, bar.set_postfix_str if show_bar else None)
        try:
            with stopper, shown:
                self._steps(job, stopper, sinks, bar)
            final = self.config.run_dir / "final_model"
            job.save_final(final)
            extra = self.at_end() if self.at_end is not None else None
            _close(sinks)  # flushed before they are published
            self.place.publish(*self.published_at_end)
            where = f"{self.place.location}/final_model" if self.place.url else final
            print(f"trained model: {where}" + (f"\n{extra}" if extra else ""))
        finally:
            bar.close()
            _close(sinks)

    def _steps(self, job: SteppedJob, stopper: GracefulStop, sinks: list[MetricSink], bar: tqdm) -> None:
        saved_at = self._latest_saved()
        abandoned = False
        try:
            while job.completed_steps < self.total and not stopper.requested:
                metrics = job.step()
                for observe in self.observers:
                    observe(metrics)
                for sink in sinks:
                    sink.write(metrics)
                bar.update(1)
                every, done = self.config.checkpoint.every_steps, job.completed_steps
                if done == self.total or (every and done % every == 0):
                    saved_at = self._checkpoint(job)
        except StepAbandoned:
            abandoned = True
            if not job.restore_abandoned_step():
                message = stopped_message(self.place.location, job.completed_steps, saved_at, job.command, True)
                raise RunInterrupted(message, stopper.signum or signal.SIGINT, abandoned) from None
        done = job.completed_steps
        if done < self.total:
            if self.config.checkpoint.on_interrupt and saved_at != done and done > 0:
                saved_at = self._checkpoint(job)
            message = stopped_message(self.place.location, done, saved_at, job.command)
            raise RunInterrupted(message, stopper.signum or signal.SIGINT, abandoned)

    def _checkpoint(self, job: SteppedJob) -> int:
        from postrl.run.checkpoint import list_checkpoints

        path = job.checkpoint()
        self.place.publish_checkpoint(path, list_checkpoints(self.config.run_dir))
        return job.completed_steps

    def _latest_saved(self) -> int | None:
        checkpoint = latest_checkpoint(self.config.run_dir)
        return None if checkpoint is None else int(checkpoint.name.split("_")[1])


def _close(sinks: list[MetricSink]) -> None:
    """Close each sink once (the list is emptied)."""
    while sinks:
        sinks.pop(0).close()
