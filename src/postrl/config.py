"""One validated config model per component, loaded from YAML plus dotted ``key=value`` overrides.

Unknown keys and bad values fail before any work starts, with a message naming the field, the
value given and what is allowed (:class:`ConfigError`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from postrl.config_base import Section
from postrl.reward_config import (  # noqa: F401 - the config's public names
    POOLED_TYPES,
    CodeComponent,
    CustomComponent,
    RemoteRewardConfig,
    RewardComponentConfig,
    RewardConfig,
    SandboxConfig,
)


class ConfigError(ValueError):
    """A config that cannot be used; the message names every offending field."""


_Section = Section


class ModelConfig(_Section):
    path: str = Field("demo", description="A local Hugging Face folder, a hub id, or 'demo' for the shipped model.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype for training and rollout.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")


class DataConfig(_Section):
    task: str | None = Field(None, description="A built-in task name (see postrl.tasks); replaces train_files.")
    train_files: list[str] = Field(default_factory=list, description="JSONL or Parquet prompt files.")
    prompt_column: str = Field("prompt", description="Column holding a prompt string.")
    messages_column: str = Field("messages", description="Column holding a chat message list.")
    apply_chat_template: bool = Field(False, description="Also wrap string prompts as one user message.")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longer prompts are an error (or skipped). None: the model's context length minus "
        "rollout.max_tokens. A value whose sum with rollout.max_tokens exceeds the context is refused at start.")
    on_bad_row: Literal["error", "skip"] = Field("error", description="Malformed or too-long rows: fail or skip+count.")
    shuffle: bool = Field(True, description="Reshuffle the prompts every epoch (seeded).")

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str | None) -> str | None:
        from postrl.tasks import get_task

        return None if v is None else get_task(v).name

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.task is None and not self.train_files:
            raise ValueError("set data.task or data.train_files")
        if self.task is not None and self.train_files:
            raise ValueError("set only one of data.task and data.train_files")
        return self


class RolloutConfig(_Section):
    backend: Literal["auto", "native", "hf", "vllm"] = Field(
        "auto",
        description="native: postrl's engine (Llama/Qwen2/Mistral); hf: the transformers model; auto: native if "
        "supported; vllm: a vLLM server in .venv-vllm (scripts/setup_vllm.sh).",
    )
    n: int = Field(8, ge=1, description="Responses per prompt (the GRPO group size G).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_tokens: int = Field(64, ge=1, description="Maximum new tokens per response.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (kept in the response).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop tokens besides EOS.")
    max_batch_size: int = Field(256, ge=1, description="Sequences decoded together.")
    dtype: Literal["auto", "float32", "bfloat16"] | None = Field(
        None, description="Engine dtype; None = model.dtype; auto = bfloat16 where the hardware has fast bf16."
    )
    verify_sync: bool = Field(True, description="Checksum every weight sync and compare what arrived with what was sent.")
    weight_sync: Literal["memory", "safetensors"] = Field("memory", description="How new weights reach the engine.")


class RewardServerConfig(_Section):
    host: str = Field("127.0.0.1", description="Bind address; loopback unless told otherwise.")
    port: int = Field(8100, ge=0, le=65535)
    token_env: str | None = Field(None, description="Env var holding the bearer token requests must carry.")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="Larger request bodies are refused (413).")
    max_batch: int = Field(4096, ge=1, description="Larger batches are refused (413).")


class RewardServiceFile(_Section):
    """The file given to `postrl serve-reward --config`: a reward section and a server section."""

    reward: RewardConfig = Field(default_factory=RewardConfig)
    server: RewardServerConfig = Field(default_factory=RewardServerConfig)
    import_paths: list[str] = Field(
        default_factory=list, description="Folders put on the import path for custom reward functions; the "
        "config file's folder is added when it is loaded.")


class AlgorithmConfig(_Section):
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules imported before the names below are looked up, so that their @register_advantage, "
        "@register_policy_loss and @register_loss_aggregation entries exist (a module next to the config imports "
        "as is; see import_paths).")
    advantage: str = Field("grpo", description="Advantage estimator (registry name).")
    policy_loss: str = Field("ppo_clip", description="Policy loss (registry name).")
    loss_agg: str = Field("token_mean", description="Loss aggregation (registry name).")
    clip_eps_low: float = Field(0.2, ge=0.0)
    clip_eps_high: float = Field(0.2, ge=0.0)
    kl_beta: float = Field(0.0, ge=0.0, description="KL-to-reference coefficient; 0 loads no reference model.")
    norm_by_std: bool = Field(True, description="GRPO: divide by the group's reward std.")

    @field_validator("plugins")
    @classmethod
    def _import_plugins(cls, modules: list[str]) -> list[str]:
        import importlib

        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                raise ValueError(f"algorithm.plugins: cannot import '{name}': {exc}") from None
        return modules

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, v: str) -> str:
        from postrl.algorithms import ADVANTAGES

        return ADVANTAGES.check(v)

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        from postrl.algorithms import POLICY_LOSSES

        return POLICY_LOSSES.check(v)

    @field_validator("loss_agg")
    @classmethod
    def _known_agg(cls, v: str) -> str:
        from postrl.algorithms import LOSS_AGGREGATIONS

        return LOSS_AGGREGATIONS.check(v)


class TrainConfig(_Section):
    lr: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup, in optimizer steps.")
    grad_clip: float = Field(1.0, gt=0.0)
    mini_batch_size: int = Field(64, ge=1, description="Sequences per optimizer step.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per forward/backward.")
    epochs: int = Field(1, ge=1, description="Passes over each step's experiences.")
    max_consecutive_nan: int = Field(3, ge=1, description="Stop the run after this many skipped updates in a row.")
    precision: Literal["float32", "bf16_autocast"] = Field(
        "float32", description="bf16_autocast: forward/backward matmuls in bf16, fp32 weights and optimizer state."
    )
    attention: Literal["auto", "eager", "sdpa"] = Field(
        "auto",
        description="Attention kernel of the trained model. auto: eager on CPU (PyTorch's CPU SDPA backward is "
        "~20x slower than its forward), sdpa elsewhere.",
    )

    @model_validator(mode="after")
    def _micro_fits_mini(self) -> TrainConfig:
        if self.micro_batch_size > self.mini_batch_size:
            raise ValueError(
                f"train.micro_batch_size={self.micro_batch_size} must be <= train.mini_batch_size={self.mini_batch_size}"
            )
        return self


class CheckpointConfig(_Section):
    every_steps: int = Field(10, ge=0, description="Write a checkpoint every k steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    on_interrupt: bool = Field(
        True, description="On Ctrl-C/SIGTERM, checkpoint the last completed step before exiting (resume from it).")


class LoggingConfig(_Section):
    console: bool = Field(True, description="One line of metrics per step on stdout.")
    progress_bar: bool = Field(True, description="A progress bar on a terminal (never when stderr is not a TTY).")
    jsonl: bool = Field(True, description="metrics.jsonl in the run directory.")
    tensorboard: bool = Field(True, description="TensorBoard event files under tensorboard/.")
    samples_first_steps: int = Field(
        3, ge=0, description="Write every sample of steps 1..k to samples/step_N.jsonl (prompt, response, reward, "
        "each component and its reason, error).")
    samples_every: int = Field(10, ge=0, description="Also write the samples of every k-th step; 0 = never.")


class RunConfig(_Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$", description="Run folder name under output_dir.")
    output_dir: str = Field("runs", description="Runs go to output_dir/name.")
    seed: int = 0
    import_paths: list[str] = Field(
        default_factory=list,
        description="Folders put on the import path for custom reward functions (module:function). The folder "
        "of the config file is added when the config is loaded, so a module next to it imports as is.")
    steps: int = Field(100, ge=1)
    prompts_per_step: int = Field(16, ge=1)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=lambda: DataConfig(task="arithmetic"))
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="before")
    @classmethod
    def _import_paths_first(cls, data: Any) -> Any:
        """Put import_paths on sys.path before the sections are checked: algorithm.plugins and
        custom reward functions may live next to the config."""
        if isinstance(data, dict) and isinstance(data.get("import_paths"), list):
            activate_import_paths([str(p) for p in data["import_paths"]])
        return data

    @model_validator(mode="after")
    def _groups_need_samples(self) -> RunConfig:
        from postrl.algorithms import ADVANTAGES

        if ADVANTAGES.needs_groups(self.algorithm.advantage) and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.advantage={self.algorithm.advantage} compares the samples of a prompt, so it needs "
                f"rollout.n >= 2 (got {self.rollout.n}: every advantage would be 0 and nothing would be learned)"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def _describe(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """The allowed field names at ``loc``, for an 'unknown field' message."""
    current: Any = model
    for part in loc[:-1]:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return ""
        current = field.annotation
    names = sorted(getattr(current, "model_fields", {}))
    return f" (allowed: {', '.join(names)})" if names else ""


def format_validation_error(err: ValidationError, model: type[BaseModel] = RunConfig) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "<config>"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config field '{where}'{_describe(model, loc)}")
        elif e["type"] == "missing":
            lines.append(f"config field '{where}' is required")
        elif e["type"] == "value_error":  # our own validators: the message names the fields
            message = e["msg"].removeprefix("Value error, ")
            lines.append(message if not loc else f"config field '{where}': {message}")
        else:
            lines.append(f"config field '{where}': got {e.get('input')!r}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from exc
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def build_config(data: dict[str, Any], overrides: list[str] | None = None, model: type[Any] = None) -> Any:
    """Validate ``data`` + overrides as ``model`` (default :class:`RunConfig`)."""
    model = model or RunConfig
    data = apply_overrides(copy.deepcopy(data), overrides or [])
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, model)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None, model: type[Any] = None,
                import_config_dir: bool = True) -> Any:
    """A YAML file + dotted overrides validated as ``model`` (default :class:`RunConfig`).

    With ``import_config_dir``, the file's folder joins ``import_paths`` (when the model has that
    field), so a reward module next to the config imports without PYTHONPATH."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
        if import_config_dir and "import_paths" in (model or RunConfig).model_fields:
            here = str(path.resolve().parent)
            paths = data.get("import_paths") or []
            if isinstance(paths, list) and here not in paths:
                data = {**data, "import_paths": [*paths, here]}
    return build_config(data, overrides, model)


def activate_import_paths(paths: list[str]) -> None:
    """Put ``paths`` and the working directory on ``sys.path`` (the scoring workers inherit it)."""
    import os
    import sys

    for folder in [os.getcwd(), *paths]:
        folder = os.path.abspath(folder)
        if folder not in sys.path:
            sys.path.insert(0, folder)


def save_config(config: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
