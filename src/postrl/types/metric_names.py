"""Every metric name the code writes or reads, in one place: producers and readers (the watches,
the adaptive KL, Prometheus, the console, the report, the plots, the docs test) import these, so a
renamed metric cannot silently turn into NaN at its reader. ``tests/test_layout.py`` refuses a
metric name written as a string anywhere else in ``src/postrl``.

Names built from a part (a reward component's mean, a stage's seconds, an agent run's figures)
come from the functions at the end."""

from __future__ import annotations

# the step
ACCURACY = "accuracy"

# the policy update
ACTOR_APPROX_KL = "actor/approx_kl"
ACTOR_CLIP_FRACTION = "actor/clip_fraction"
ACTOR_CLIP_HIGH = "actor/clip_high"
ACTOR_CLIP_LOW = "actor/clip_low"
ACTOR_DUAL_CLIP = "actor/dual_clip"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_KL = "actor/kl"
ACTOR_KL_BETA = "actor/kl_beta"
ACTOR_LOSS = "actor/loss"
ACTOR_LR = "actor/lr"
ACTOR_SKIPPED_UPDATES = "actor/skipped_updates"
# the share of an update (|change| of the float32 master weights) that moves their bf16 rounding
TRAIN_UPDATE_VISIBLE_BF16 = "train/update_visible_bf16"

# the Experience Buffer
BUFFER_DROPPED = "buffer/dropped"
BUFFER_LAG_MASKED_TOKENS = "buffer/lag_masked_tokens"
BUFFER_LAG_MAX = "buffer/lag_max"
BUFFER_LAG_MEAN = "buffer/lag_mean"
BUFFER_SIZE = "buffer/size"

# the critic's update
CRITIC_CLIP_FRACTION = "critic/clip_fraction"
CRITIC_VALUE_LOSS = "critic/value_loss"

# the data
DATA_EPOCH = "data/epoch"
DATA_SKIPPED_ROWS = "data/skipped_rows"

# postrl dpo
DPO_CHOSEN_REWARD = "dpo/chosen_reward"
DPO_LOSS = "dpo/loss"
DPO_MARGIN = "dpo/margin"
DPO_REJECTED_REWARD = "dpo/rejected_reward"
DPO_REWARD_ACCURACY = "dpo/reward_accuracy"

# the KL penalty
KL_REWARD_PENALTY = "kl/reward_penalty"

# on-policy distillation (algorithm.distill)
DISTILL_REVERSE_KL = "distill/reverse_kl"  # student - teacher logprob, mean over the taught tokens
# samples sent to a teacher / samples taught: at most 1, below it where identical samples were sent once
# or a sample's logprobs were kept from an earlier step (a sample is never sent twice)
DISTILL_TEACHER_CALLS_PER_SAMPLE = "distill/teacher_calls_per_sample"
DISTILL_CACHED = "distill/cached"  # samples whose teacher logprobs were kept from an earlier step
DISTILL_UNSCORABLE = "distill/unscorable"  # samples whose teacher failed (unscorable, as reward failures)
DISTILL_UNTAUGHT = "distill/untaught"  # samples of a task no teacher applies to

# throughput
PERF_GEN_TOKENS_PER_S = "perf/gen_tokens_per_s"
PERF_TRAIN_TOKENS_PER_S = "perf/train_tokens_per_s"

# response lengths
RESPONSE_CLIP_RATIO = "response/clip_ratio"
RESPONSE_LENGTH_MAX = "response/length_max"
RESPONSE_LENGTH_MEAN = "response/length_mean"

# the step's rewards
REWARD_FLAGGED = "reward/flagged"
REWARD_MAX = "reward/max"
REWARD_MEAN = "reward/mean"
REWARD_MIN = "reward/min"
REWARD_NO_SIGNAL_GROUPS = "reward/no_signal_groups"
REWARD_SAMPLES = "reward/samples"
REWARD_SERVICE_ERRORS = "reward/service_errors"
REWARD_STD = "reward/std"
REWARD_UNSCORABLE = "reward/unscorable"

# the rollout engines and the off-policy correction
ROLLOUT_ENGINE_HEALTHY = "rollout/engine_healthy"
ROLLOUT_ENGINE_RESTARTS = "rollout/engine_restarts"
ROLLOUT_ENGINES = "rollout/engines"
ROLLOUT_PREFILL_S = "rollout/prefill_s"  # seconds the engines spent prefilling in the step
ROLLOUT_DECODE_S = "rollout/decode_s"  # and decoding
ROLLOUT_UPDATES_MID_GENERATE = "rollout/updates_mid_generate"  # weight updates applied inside a generate
ROLLOUT_IS_REJECTED_FRACTION = "rollout/is_rejected_fraction"
ROLLOUT_IS_WEIGHT_MAX = "rollout/is_weight_max"
ROLLOUT_IS_WEIGHT_MEAN = "rollout/is_weight_mean"
ROLLOUT_LOGPROB_DIFF_MAX = "rollout/logprob_diff_max"
ROLLOUT_MISMATCH_KL = "rollout/mismatch_kl"
ROLLOUT_PARTIAL_ROLLOUTS = "rollout/partial_rollouts"
ROLLOUT_SUSPENDED_BATCHES = "rollout/suspended_batches"
ROLLOUT_WEIGHT_VERSION = "rollout/weight_version"

# postrl sft
SFT_LOSS = "sft/loss"
SFT_PERPLEXITY = "sft/perplexity"
SFT_TOKENS = "sft/tokens"

# weight syncs
SYNC_BYTES = "sync/bytes"
SYNC_FAILURES = "sync/failures"

# seconds per stage
TIME_GENERATE_S = "time/generate_s"
TIME_PRODUCER_WAITED_S = "time/producer_waited_s"
TIME_REWARD_S = "time/reward_s"
TIME_STEP_S = "time/step_s"
TIME_SYNC_S = "time/sync_s"
TIME_TRAIN_S = "time/train_s"
TIME_VALIDATE_S = "time/validate_s"
TIME_WEIGHT_PUSH_S = "time/weight_push_s"

# validation
VAL_ACCURACY = "val/accuracy"
VAL_PROMPTS = "val/prompts"
VAL_RESPONSE_LENGTH = "val/response_length"
VAL_REWARD_MEAN = "val/reward_mean"
VAL_UNSCORABLE = "val/unscorable"

AGENT = "agent"  # prefix of an agent run's episode figures (agent/turns_mean, ...)
VAL_AGENT = "val/agent"  # the same for validation episodes


def seconds_of(stage: str) -> str:
    """The seconds a step spent in ``stage`` (``time/<stage>_s``)."""
    return f"time/{stage}_s"


def component_mean(component: str, prefix: str = "reward") -> str:
    """The mean of one reward component over the step's (``reward/``) or validation's (``val/``) samples."""
    return f"{prefix}/{component}/mean"


def task_accuracy(task: str, prefix: str = "") -> str:
    """The accuracy over one task's samples (a row's ``task_type``): ``accuracy/<task>`` in training,
    ``val/<task>/accuracy`` (or ``val/<set>/<task>/accuracy``) in validation."""
    return f"{prefix}/{task}/accuracy" if prefix else f"accuracy/{task}"


def eval_set(name: str) -> str:
    """The prefix of a named eval set's validation figures (``val/<set>``)."""
    return f"val/{name}"


def teacher_metric(teacher: str, figure: str) -> str:
    """One teacher's figure (``distill/<teacher>/<figure>``: reverse_kl, samples)."""
    return f"distill/{teacher}/{figure}"


def curriculum_level(task: str) -> str:
    """A leveled task's current curriculum level."""
    return f"curriculum/{task}/level"


def curriculum_accuracy(task: str) -> str:
    """The accuracy over a leveled task's window of recent training samples."""
    return f"curriculum/{task}/accuracy"
