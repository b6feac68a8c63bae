"""How far training may run off-policy: the Experience Buffer's staleness bound and replay, the
controller's mode (sync, or async with generation running ahead of training), and the rollout
engine's behaviour when new weights arrive mid-generation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from postrl.config.base import Section


class ReplayConfig(Section):
    capacity_steps: int = Field(
        2,
        ge=1,
        description="The buffer keeps the experiences of the last N steps and samples training batches from them.",
    )
    reuse_limit: int = Field(2, ge=1, description="An experience is trained on at most this many times, then evicted.")


class BufferConfig(Section):
    max_staleness: int = Field(
        0,
        ge=0,
        description="The largest lag (trainer's weight version minus the version that generated a sample) a "
        "trained sample may have; 0: on-policy. In async mode also how many batches generation may run ahead.",
    )
    on_stale: Literal["wait", "drop"] = Field(
        "wait",
        description="wait: generation is held back (async mode) until the engines have weights recent enough that "
        "nothing goes stale, and a stale sample at get() is an error; drop: generation runs on whatever weights "
        "the engines have, and a sample beyond max_staleness is dropped at get() and counted (buffer/dropped).",
    )
    replay: ReplayConfig | None = Field(
        None, description="Train on seeded random samples (whole groups) of the last N steps; None: each step's own."
    )

    @model_validator(mode="after")
    def _replay_fits_staleness(self) -> BufferConfig:
        if self.replay is not None and self.max_staleness < self.replay.capacity_steps - 1:
            raise ValueError(
                f"buffer.replay.capacity_steps={self.replay.capacity_steps} keeps samples up to "
                f"{self.replay.capacity_steps - 1} versions old, beyond buffer.max_staleness={self.max_staleness}: "
                f"set max_staleness >= {self.replay.capacity_steps - 1}"
            )
        return self


class ControllerConfig(Section):
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: generate, score, train, sync one after another. async: generation and scoring run in "
        "their own thread ahead of training (at most buffer.max_staleness batches), weights reach the engines "
        "in the background.",
    )
    overlap: Literal["auto", "scoring", "generation"] = Field(
        "auto",
        description="async: what runs beside training. scoring: the next batch is generated between two updates "
        "and scored (and the weights sent) while the update runs; the faster choice where generation and training "
        "share the cores (a CPU, one GPU). generation: a producer thread generates and scores ahead, for engines "
        "in processes or on devices of their own. auto: generation under scheduler: ray (every worker is an "
        "actor), scoring otherwise.",
    )
    producer_threads: int = Field(
        1,
        ge=1,
        description="async: torch threads of the producer (overlap: generation) and weight-sync threads. A second "
        "thread's multi-threaded OpenMP team makes the trainer's own team wake slowly (measured: training twice "
        "as slow on 2 cores even while the producer sleeps); 1 keeps the trainer at full speed.",
    )
    serial_compute: bool | None = Field(
        None,
        description="async: generation and the weight push compute on the trainer's thread between two updates, and "
        "only waiting (scoring, I/O) runs beside training; overlap: generation is then run as overlap: scoring. "
        "None: true where the engine computes in this process on the trainer's CPU, where two computations at once "
        "are slower than one after the other (docs/async.md), false otherwise and for an agent.env run that asks for "
        "overlap: generation (its episodes wait on their environments, which the producer thread hides).",
    )
