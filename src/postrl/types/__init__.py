"""The data that moves through one RL step, as typed records (no string-keyed bags of tensors).

``records``: what one sample is at each stage; ``batch``: a step's data padded once into the
training layout; ``episode``: a multi-turn episode's turns; ``metrics``: what an update and a step report.
"""

from postrl.types.batch import ExperienceBatch, Padded, StepBatch, group_ids_of, pad_sequences
from postrl.types.metrics import StepMetrics, TrainMetrics
from postrl.types.records import (
    OPTIONAL_PER_TOKEN,
    BufferBatch,
    Experience,
    FinishReason,
    Health,
    PreferencePair,
    Prompt,
    RewardResult,
    Rollout,
    SamplingParams,
    Score,
    ScoreRequest,
    TokenCallback,
    compact_versions,
)

__all__ = [
    "OPTIONAL_PER_TOKEN",
    "BufferBatch",
    "Health",
    "Experience",
    "ExperienceBatch",
    "FinishReason",
    "Padded",
    "PreferencePair",
    "Prompt",
    "RewardResult",
    "Rollout",
    "SamplingParams",
    "Score",
    "ScoreRequest",
    "StepBatch",
    "StepMetrics",
    "TokenCallback",
    "TrainMetrics",
    "compact_versions",
    "group_ids_of",
    "pad_sequences",
]
