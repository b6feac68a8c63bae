"""What a Controller drives, as one record built by :func:`postrl.run.train_runner.build_components`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from postrl.config.run import RunConfig
from postrl.controller.source import BatchSource
from postrl.data.prompt_source import PromptSource
from postrl.models.numerics import Numerics
from postrl.scheduling.base import Scheduler
from postrl.workers.roles import Critic, ExperienceStore, RewardService, ScalableRolloutWorker, Teachers, TrainWorker


class Tokenizer(Protocol):
    pad_token_id: int
    chat_template: str | None

    def save_pretrained(self, folder: Any) -> Any: ...


@dataclass
class Components:
    config: RunConfig
    tokenizer: Tokenizer
    prompts: PromptSource  # the training prompts, their order and the held-out ones
    rollout: ScalableRolloutWorker
    reward: RewardService
    trainer: TrainWorker
    buffer: ExperienceStore
    source: BatchSource  # where each batch's rollouts and rewards come from
    scheduler: Scheduler | None = None  # placed the workers; closed last
    critic: Critic | None = None  # when algorithm.critic is set (PPO with GAE)
    teachers: Teachers | None = None  # when algorithm.distill is set
    numerics: Numerics | None = None  # how the engine and the trainer compute, resolved at start
