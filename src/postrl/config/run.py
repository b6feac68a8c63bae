"""One validated config model per component, loaded from YAML plus dotted ``key=value`` overrides.

Unknown keys and bad values fail before any work starts, with a message naming the field, the
value given and what is allowed (:class:`ConfigError`).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, ValidationError, model_validator

from postrl.config.agent import AgentConfig, EnvAgent, FunctionAgent, SeatedAgent, VerifiersAgent
from postrl.config.algorithm import AlgorithmConfig  # noqa: F401 - the config's public names
from postrl.config.base import Section
from postrl.config.command import RunCommandConfig
from postrl.config.data import DataConfig
from postrl.config.model import LoraConfig, ModelConfig  # noqa: F401 - the config's public names
from postrl.config.observability import PlanConfig
from postrl.config.off_policy import BufferConfig, ControllerConfig
from postrl.config.policies import POLICY_NAME, POLICY_SECTIONS, PolicyConfig, check_seats, merged
from postrl.config.reward import (  # noqa: F401 - the config's public names
    CodeComponent,
    CustomComponent,
    ReasoningGymComponent,
    RemoteRewardConfig,
    RewardComponentConfig,
    RewardConfig,
    SandboxConfig,
)
from postrl.config.rollout import (  # noqa: F401 - the config's public names
    NativeEngineConfig,
    RolloutConfig,
    VLLMEngineConfig,
    exact_dtype_message,
)
from postrl.config.scheduler import SchedulerConfig
from postrl.config.training import CheckpointConfig, TrainConfig  # noqa: F401 - the config's public names


class ConfigError(ValueError):
    """A config that cannot be used; the message names every offending field."""


class RewardServerConfig(Section):
    host: str = Field("127.0.0.1", description="Bind address; loopback unless told otherwise.")
    port: int = Field(8100, ge=0, le=65535, description="Port to listen on (0: any free port).")
    token_env: str | None = Field(None, description="Env var holding the bearer token requests must carry.")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="Larger request bodies are refused (413).")
    max_batch: int = Field(4096, ge=1, description="Larger batches are refused (413).")


class RewardServiceFile(Section):
    """The file given to `postrl serve-reward --config`: a reward section and a server section."""

    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="What to score and how (as in a train config)."
    )
    server: RewardServerConfig = Field(default_factory=RewardServerConfig, description="Where and how to serve it.")
    import_paths: list[str] = Field(
        default_factory=list,
        description="Folders put on the import path for custom reward functions; the "
        "config file's folder is added when it is loaded.",
    )


class RunConfig(RunCommandConfig):
    """``postrl train``: an RL run."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$", description="Run folder name under output_dir.")
    keep_local_copy: bool = Field(
        False,
        description="A URL run (output_dir s3://...) works in a local copy, "
        "removed once the run has ended well and everything is published; true keeps it.",
    )
    import_paths: list[str] = Field(
        default_factory=list,
        description="Folders put on the import path for custom reward functions (module:function). The folder "
        "of the config file is added when the config is loaded, so a module next to it imports as is.",
    )
    steps: int = Field(100, ge=1, description="RL steps (generate, score, update, sync) to run in all.")
    prompts_per_step: int = Field(16, ge=1, description="Prompts sampled per step; each gets rollout.n responses.")
    data: DataConfig = Field(default_factory=lambda: DataConfig(task="arithmetic"), description="The prompts.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="How responses are generated.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How responses are scored.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages, loss and KL.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The optimizer and batching.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Staleness bound and replay of experiences.")
    controller: ControllerConfig = Field(default_factory=ControllerConfig, description="Sync or async steps.")
    plan: PlanConfig = Field(default_factory=PlanConfig, description="The memory check before a run starts.")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig,
        description="Where the workers run (`scheduler: ray` is short for `scheduler: {type: ray}`).",
    )
    agent: AgentConfig | None = Field(
        None, description="Multi-turn episodes with tools and an environment instead of one response per prompt."
    )
    policies: dict[str, PolicyConfig] | None = Field(
        None,
        description="Several trainable policies acting in the same episodes (agent.function picks one per model "
        "call by its model name or base URL); each merges its model/train/rollout/algorithm over the run's. "
        "None: one policy, the run's own sections.",
    )

    @model_validator(mode="before")
    @classmethod
    def _scheduler_shorthand(cls, data: Any) -> Any:
        """``scheduler: ray`` is short for ``scheduler: {type: ray}``."""
        if isinstance(data, dict) and isinstance(data.get("scheduler"), str):
            data = {**data, "scheduler": {"type": data["scheduler"]}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _verifiers_prompts_are_its_dataset(cls, data: Any) -> Any:
        """An ``agent.verifiers`` run draws its prompts from the environment (``data.environment``)
        unless ``data`` names another source, which :meth:`_environment_prompts_need_one` refuses."""
        agent = data.get("agent") if isinstance(data, dict) else None
        if not (isinstance(agent, VerifiersAgent) or (isinstance(agent, dict) and agent.get("verifiers") is not None)):
            return data
        given = data.get("data") or {}
        if isinstance(given, dict) and not any(given.get(k) for k in ("task", "train_files", "reasoning_gym")):
            data = {**data, "data": {**given, "environment": True}}
        return data

    @model_validator(mode="after")
    def _environment_prompts_need_one(self) -> RunConfig:
        if isinstance(self.agent, VerifiersAgent) and not self.data.environment:
            d = self.data
            source = "task" if d.task else "train_files" if d.train_files else "reasoning_gym"
            raise ValueError(
                f"agent.verifiers: the prompts are the environment's own dataset (its eval split held out): remove "
                f"data.{source}"
            )
        if self.data.environment and not isinstance(self.agent, VerifiersAgent):
            raise ValueError("data.environment: the prompts of an environment's own dataset need agent.verifiers")
        if isinstance(self.agent, VerifiersAgent) and self.data.val_files:
            raise ValueError(
                "agent.verifiers: the held-out prompts are the environment's eval split: remove data.val_files"
            )
        return self

    @model_validator(mode="after")
    def _gym_rows_scored_by_their_scorer(self) -> RunConfig:
        """reasoning-gym problems without a reward section are scored by reasoning-gym's own scorer."""
        if self.data.reasoning_gym is not None and "reward" not in self.model_fields_set:
            self.reward = RewardConfig(components=[ReasoningGymComponent(name="correct", type="reasoning_gym")])
        return self

    @model_validator(mode="after")
    def _exact_rollout_fits_the_run(self) -> RunConfig:
        """rollout.exact computes the trainer's logprobs with the engine's exact operations; what that
        cannot match is refused here, and dtypes that resolve apart on the machine at start."""
        r, t = self.rollout, self.train
        if not r.exact:
            return self
        if r.backend not in ("auto", "native"):
            raise ValueError(f"rollout.exact needs the native engine (rollout.backend=native), not {r.backend}")
        if t.forward != "lean":
            raise ValueError(
                f"rollout.exact computes the trainer's logprobs with the engine's exact forward: train.forward="
                f"{t.forward} does not apply (remove it)"
            )
        if self.model.lora is not None:
            raise ValueError("rollout.exact does not support model.lora (the exact forward has no adapter path)")
        dtype = r.dtype or self.model.dtype
        trainer = {"float32": "float32", "bf16_autocast": "bfloat16"}.get(t.precision)  # auto: on the machine
        if self.model.dtype == "bfloat16":
            trainer = "bfloat16"  # bf16 parameters compute in bf16 whatever the precision
        if dtype != "auto" and trainer is not None and dtype != trainer:
            raise ValueError(exact_dtype_message(dtype, t.precision, dtype, trainer))
        return self

    @model_validator(mode="after")
    def _openai_backend_needs_a_url(self) -> RunConfig:
        r = self.rollout
        if r.backend == "openai" and (r.url is None or r.sync_dir is None):
            raise ValueError(
                "rollout.backend=openai needs rollout.url (the server or router) and rollout.sync_dir "
                "(the folder the servers read new weights from: their --weights-dir)"
            )
        return self

    @model_validator(mode="after")
    def _lora_fits_the_run(self) -> RunConfig:
        lora = self.model.lora
        if lora is None:
            return self
        if lora.sync == "adapter" and self.rollout.backend not in ("auto", "native", "vllm"):
            raise ValueError(
                f"model.lora.sync=adapter sends adapters that the native and vLLM engines apply unmerged; "
                f"rollout.backend={self.rollout.backend} takes whole weights: use model.lora.sync: merged"
            )
        return self

    @model_validator(mode="after")
    def _broadcast_needs_remote_engines(self) -> RunConfig:
        s = self.scheduler
        if self.rollout.weight_sync == "broadcast" and s.type == "local" and s.rollout.workers == 1:
            raise ValueError(
                "rollout.weight_sync=broadcast sends weights to engines in other processes, but a local "
                "run with scheduler.rollout.workers=1 keeps its engine in this process; use "
                "weight_sync=memory, scheduler.rollout.workers >= 2, or scheduler: ray"
            )
        return self

    @model_validator(mode="after")
    def _async_needs_a_staleness_bound(self) -> RunConfig:
        if self.controller.mode == "async" and self.buffer.max_staleness < 1:
            raise ValueError(
                "controller.mode=async generates batches while older ones train, so they lag the trainer by at "
                "least one version: set buffer.max_staleness >= 1 (1 is one-step-off)"
            )
        if self.controller.mode == "async" and self.scheduler.rollout_schedule:
            raise ValueError(
                "scheduler.rollout_schedule resizes the rollout pool between steps, which controller.mode=async "
                "does not have (generation runs ahead); leave one of them out"
            )
        return self

    @model_validator(mode="after")
    def _agent_tasks_need_an_agent(self) -> RunConfig:
        from postrl.tasks import get_task

        env = None if self.data.task is None else get_task(self.data.task).environment
        if env is not None and self.agent is None:
            raise ValueError(
                f"data.task={self.data.task} is a multi-turn task: set agent.env={env} (agent: {{env: {env}}})"
            )
        return self

    @model_validator(mode="after")
    def _suspended_episodes_can_resume(self) -> RunConfig:
        """overlap=generation suspends episodes at a checkpoint and continues them from their saved
        state: environment episodes scheduled individually (an agent.function's episodes run again
        from their start, their recorded calls replayed)."""
        if self.agent is None or self.controller.mode != "async" or self.requested_overlap != "generation":
            return self
        if isinstance(self.agent, EnvAgent) and self.agent.scheduling != "individual":
            raise ValueError(
                "controller.overlap=generation suspends episodes between turns, which agent.scheduling=lockstep "
                "does not do: set agent.scheduling=individual, or controller.overlap=scoring"
            )
        return self

    @model_validator(mode="after")
    def _policies_fit_the_run(self) -> RunConfig:
        if self.policies is None:
            if isinstance(self.agent, SeatedAgent):
                raise ValueError(
                    "agent.seats: seats are played by the run's policies: name them under policies: (one per seat)"
                )
            return self
        if len(self.policies) < 2:
            raise ValueError(
                "policies: names one policy; a run with one policy is configured by its own model/train/rollout/"
                "algorithm sections (leave policies out)"
            )
        for name, policy in self.policies.items():
            if not re.match(POLICY_NAME, name):
                raise ValueError(f"policies.{name}: a policy's name starts with a letter, then letters, digits, _ . -")
            if "n" in policy.rollout:
                raise ValueError(
                    f"policies.{name}.rollout.n: every policy acts in the same rollout.n episodes of a prompt; "
                    "set rollout.n for the run"
                )
        if not isinstance(self.agent, FunctionAgent | SeatedAgent):
            raise ValueError(
                "policies: the policies act in the episodes of an agent function (agent.function), which picks "
                "the policy of each model call by its model name or base URL, or of a seated environment (agent.env "
                "with agent.seats: its seat -> the policy that plays it)"
            )
        if isinstance(self.agent, SeatedAgent):
            check_seats(self.agent.seats, list(self.policies))
        if self.controller.mode == "async" and self.requested_overlap == "generation":
            asked = "asked" if self.controller.overlap == "generation" else "auto under Ray"
            raise ValueError(
                f"policies: controller.overlap=generation ({asked}) is not supported with several policies yet (the "
                "policies' producers would need one staleness gate and one pause, docs/agentic.md): set "
                "controller.overlap=scoring"
            )
        self.policy_runs()  # each policy's run validates, its errors named by policies.NAME
        return self

    def policy_runs(self) -> dict[str, RunConfig]:
        """Each policy's run: the run's config with the policy's sections merged over its own, writing
        under ``RUN_DIR/policies/NAME`` (samples, unscored steps); the run's one checkpoint holds them all."""
        if self.policies is None:
            return {}
        base = self.model_dump(exclude={"policies"})
        runs = {}
        for name, policy in self.policies.items():
            data = dict(base)
            for section in POLICY_SECTIONS:
                data[section] = merged(base[section], getattr(policy, section))
            data.update(output_dir=str(self.run_dir / "policies"), name=name)
            if data.get("agent") is not None:  # the seats and the games' time limit are the shared episodes'
                data["agent"] = {k: v for k, v in data["agent"].items() if k not in ("seats", "function_timeout_s")}
            try:
                runs[name] = RunConfig.model_validate(data)
            except ValidationError as exc:
                raise ValueError(f"policies.{name}: {field_errors(exc)}") from None
        return runs

    @property
    def on_policy(self) -> bool:
        """Every sample is trained by the weights that generated it: a sync run that neither keeps
        stale samples nor replays them (otherwise samples lag the trainer by design)."""
        return self.controller.mode == "sync" and self.buffer.max_staleness == 0 and self.buffer.replay is None

    @property
    def scores_with_components(self) -> bool:
        """Whether ``reward.components`` score this run's samples: not in an agent run whose
        environment (or agent function) gives the reward (``agent.reward: environment``)."""
        return self.agent is None or self.agent.reward == "service"

    @property
    def requested_overlap(self) -> str:
        """``controller.overlap`` as the config asks (auto: generation under Ray, scoring locally); what
        runs is resolved for the machine (:func:`postrl.controller.overlap.resolve_overlap`)."""
        overlap = self.controller.overlap
        if overlap == "auto":
            return "generation" if self.scheduler.type == "ray" else "scoring"
        return overlap

    @model_validator(mode="after")
    def _groups_need_samples(self) -> RunConfig:
        from postrl.algorithms import ADVANTAGES

        if ADVANTAGES.needs(self.algorithm.advantage.type).groups and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.advantage={self.algorithm.advantage.type} compares the samples of a prompt, so it needs "
                f"rollout.n >= 2 (got {self.rollout.n}: every advantage would be 0 and nothing would be learned)"
            )
        return self


def field_errors(exc: ValidationError) -> str:
    """A validation error's lines in one, each naming its field (``unknown config field 'train.lrr'``)."""
    lines = []
    for e in exc.errors():
        where = ".".join(str(part) for part in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config field '{where}'")
        elif e["type"] == "value_error":
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"config field '{where}': got {e.get('input')!r}: {e['msg']}")
    return "; ".join(dict.fromkeys(lines))


def activate_import_paths(paths: list[str]) -> None:
    """Put ``paths`` and the working directory on ``sys.path`` (the scoring workers inherit it)."""
    import os
    import sys

    for folder in [os.getcwd(), *paths]:
        folder = os.path.abspath(folder)
        if folder not in sys.path:
            sys.path.insert(0, folder)
