"""The stages some algorithms add to a step, chosen once from the config (:func:`build_stages`)."""

from __future__ import annotations

from dataclasses import dataclass

from postrl.algorithms import ADVANTAGES
from postrl.algorithms.stages import STAGES
from postrl.config.data import CURRICULUM_NEEDS_ACCURACY
from postrl.config.run import ConfigError, RunConfig
from postrl.controller.stages.base import Groups, Phase, Stage, StepServices
from postrl.controller.stages.critic import CriticStage
from postrl.controller.stages.curriculum import Curriculum
from postrl.controller.stages.distill import Distillation
from postrl.controller.stages.dynamic_sampling import DynamicSampling
from postrl.controller.stages.greedy_baseline import GreedyBaseline
from postrl.controller.stages.kl import AdaptiveKL, KLCoefficient, KLPenalty
from postrl.data.curriculum import LeveledDraw
from postrl.data.sampler import PromptDraw
from postrl.workers.roles import Critic, Teachers, TrainWorker

__all__ = ["Groups", "Phase", "Stage", "StageContext", "StagePlan", "StepServices", "build_stages"]


@dataclass(frozen=True)
class StageContext:
    """What a stage's factory may use: the run's config, the step's services and the workers."""

    config: RunConfig
    services: StepServices
    trainer: TrainWorker
    critic: Critic | None
    kl: KLCoefficient
    draw: PromptDraw | None = None  # where the step's prompts come from (a curriculum moves its levels)
    accuracy_component: str | None = None  # the component whose value says a sample is correct
    teachers: Teachers | None = None  # algorithm.distill's


class StagePlan:
    """The run's stages in order, and for each phase the stages that act in it."""

    def __init__(self, stages: list[Stage]) -> None:
        names = [s.name for s in stages]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ConfigError(f"algorithm.stages: more than one stage named {', '.join(duplicated)}")
        self.stages = stages
        self.select = [s for s in stages if "select" in s.phases]
        self.prepare = [s for s in stages if "prepare" in s.phases]
        self.after_advantage = [s for s in stages if "after_advantage" in s.phases]
        self.after_update = [s for s in stages if "after_update" in s.phases]

    def policy_waits(self, completed_steps: int) -> bool:
        return any(s.policy_waits(completed_steps) for s in self.stages)

    def state_dict(self) -> dict[str, dict]:
        return {s.name: s.state_dict() for s in self.stages}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        for stage in self.stages:
            if stage.name in state:
                stage.load_state_dict(state[stage.name])


def build_stages(context: StageContext) -> StagePlan:
    """The built-in stages the config asks for, in the order a step runs them, then the user's
    (``algorithm.stages``), in the order listed."""
    a = context.config.algorithm
    stages: list[Stage] = []
    if isinstance(context.draw, LeveledDraw):  # the prompt source's curriculum
        if context.accuracy_component is None:
            raise ConfigError(CURRICULUM_NEEDS_ACCURACY)
        threshold = context.config.reward.accuracy_threshold
        stages.append(Curriculum(context.draw, context.draw.curriculum, context.accuracy_component, threshold))
    if a.dynamic_sampling:
        stages.append(DynamicSampling(context.services, a.max_extra_rounds))
    if ADVANTAGES.needs(a.advantage.type).baseline:
        stages.append(GreedyBaseline(context.services))
    if a.critic is not None and context.critic is not None:
        stages.append(CriticStage(context.critic, a.critic.warmup_steps))
    elif a.critic is not None:
        raise ConfigError("algorithm.critic is set but the run has no critic worker")
    if a.distill is not None:
        if context.teachers is None:
            raise ConfigError("algorithm.distill is set but the run has no teachers")
        c = context.config
        stages.append(Distillation(context.teachers, a.distill, c.run_dir, c.reward.max_failure_rate))
    penalty = KLPenalty(context.trainer, context.kl, a.kl_estimator, a.kl_clamp) if a.kl_in == "reward" else None
    if penalty is not None:
        stages.append(penalty)
    if a.kl_target is not None:
        stages.append(AdaptiveKL(context.kl, a.kl_target, a.kl_horizon, penalty))
    for entry in a.stages:
        stages.append(STAGES.get(entry.type)(context, **entry.params))
    check_needs(stages, context)
    return StagePlan(stages)


def check_needs(stages: list[Stage], context: StageContext) -> None:
    """Each stage's declared needs against what the run holds."""
    held = {"critic": context.critic is not None, "reference": context.config.algorithm.needs_reference}
    for stage in stages:
        missing = sorted(need for need in stage.needs if not held[need])
        if missing:
            fix = {"critic": "set algorithm.critic", "reference": "set algorithm.kl_beta > 0"}
            raise ConfigError(
                f"the {stage.name} stage needs {' and '.join(missing)}: " + "; ".join(fix[m] for m in missing)
            )
