"""The sizes that fit (tensor-parallel, FSDP, KV concurrency) and, for what does not, the changes
that would make it fit, each checked with the memory model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from postrl.config.run import RunConfig
from postrl.run.plan.inputs import SIZES, RunShape, agent_split, train_setup
from postrl.run.plan.memory import (
    RoleMemory,
    RolloutSetup,
    TrainSetup,
    micro_batch,
    rollout_memory,
    train_rank_memory,
)
from postrl.run.plan.shape import ModelShape


def _sizes(limit: int, divides: int | None = None) -> list[int]:
    return [s for s in SIZES if s <= limit and (divides is None or divides % s == 0)]


def fit_rollout(shape: ModelShape, setup: RolloutSetup, usable: int, limit: int) -> tuple[int | None, RoleMemory]:
    """The smallest tensor-parallel size (a divisor of the heads, at most ``limit``) that fits."""
    sizes = _sizes(limit, shape.heads) or [1]
    for tp in sizes:
        memory = rollout_memory(shape, setup, tp)
        if memory.total <= usable:
            return tp, memory
    return None, rollout_memory(shape, setup, sizes[-1])


def max_concurrency(shape: ModelShape, setup: RolloutSetup, usable: int, tp: int) -> int:
    """The most sequences of ``setup.max_len`` whose KV cache fits beside the weights and the work."""
    per_sequence = setup.max_len * shape.kv_bytes_per_token(setup.dtype_bytes, tp)
    base = rollout_memory(shape, replace(setup, concurrency=1), tp)
    count = max(0, (usable - base.total) // per_sequence + 1)
    while count > 0 and rollout_memory(shape, replace(setup, concurrency=count), tp).total > usable:
        count -= 1
    return int(count)


def fit_train(shape: ModelShape, setup: TrainSetup, usable: int, limit: int) -> tuple[int | None, RoleMemory]:
    """The smallest FSDP size (at most ``limit`` ranks) whose rank fits."""
    sizes = _sizes(limit) or [1]
    for f in sizes:
        memory = train_rank_memory(shape, setup, f)
        if memory.total <= usable:
            return f, memory
    return None, train_rank_memory(shape, setup, sizes[-1])


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def train_fixes(config: RunConfig, shape: ModelShape, run: RunShape, usable: int, limit: int) -> list[str]:
    """The changes that would make a train rank fit, each checked with the memory model: alone
    where one is enough, else added up in this order until they fit."""
    base = train_setup(config, run)
    fixes = []
    more, _ = fit_train(shape, base, usable, SIZES[-1])
    if more is not None and more > limit and run.accelerator:  # CPU ranks share the machine's memory
        fixes.append(f"train on {more} GPUs (scheduler.train.workers={more})")
    ranks = min(limit, SIZES[-1])
    changes: list[tuple[str, TrainSetup]] = []
    if base.lean and run.accelerator:
        changes.append(
            (
                "train.forward=transformers (SDPA attention keeps no [queries x keys] probabilities)",
                replace(base, lean=False, eager_attention=False),
            )
        )
    if not base.checkpointing:
        changes.append(
            ("model.gradient_checkpointing=true (each layer keeps its input only)", replace(base, checkpointing=True))
        )
    if base.lora_rank is None:
        changes.append(
            (
                "model.lora.r=16 (gradients and AdamW state for the adapters only)",
                replace(base, lora_rank=16, lora_targets=ALL_PROJECTIONS),
            )
        )
    fixes += [text for text, setup in changes if fit_train(shape, setup, usable, ranks)[0] is not None]
    budget = largest_token_budget(shape, base, run, usable, ranks)
    if budget is not None:
        fixes.append(f"train.micro_batch_tokens={budget} (fewer tokens per forward/backward)")
    if config.agent is not None and (context := largest_agent_context(config, shape, run, usable, ranks)) is not None:
        fixes.append(f"agent.max_context={context} (shorter episodes)")
    if not fixes:
        fixes += combined_fix(shape, base, changes, run, usable, ranks)
    return fixes or ["a GPU with more memory: no setting of this run fits"]


def combined_fix(
    shape: ModelShape, base: TrainSetup, changes: list[tuple[str, TrainSetup]], run: RunShape, usable: int, ranks: int
) -> list[str]:
    """The changes together (each replaces the field it changes), then the largest micro-batch that fits."""
    setup, texts = base, []
    for text, changed in changes:
        setup = replace(
            setup,
            **{
                f: getattr(changed, f)
                for f in ("lean", "eager_attention", "checkpointing", "lora_rank", "lora_targets")
                if getattr(changed, f) != getattr(base, f)
            },
        )
        texts.append(text.split(" (")[0])
        if fit_train(shape, setup, usable, ranks)[0] is not None:
            return ["together: " + ", ".join(texts)]
    budget = largest_token_budget(shape, setup, run, usable, ranks)
    return ["together: " + ", ".join([*texts, f"train.micro_batch_tokens={budget}"])] if budget is not None else []


def largest_token_budget(shape: ModelShape, setup: TrainSetup, run: RunShape, usable: int, ranks: int) -> int | None:
    """The largest ``train.micro_batch_tokens`` (down to one prompt and one response) that fits."""

    def fits(budget: int) -> bool:
        micro = micro_batch(1, run.n, run.prompt_tokens, run.response_tokens, budget)
        return fit_train(shape, replace(setup, micro=micro), usable, ranks)[0] is not None

    least = run.prompt_tokens + run.response_tokens
    return largest_that_fits(fits, least, max(setup.micro.tokens, least))


def largest_that_fits(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest size in ``[low, high]`` that ``fits`` (to 1/64 of it, by bisection); None when
    not even ``low`` does."""
    if not fits(low):
        return None
    while high - low > max(1, low // 64):
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def largest_agent_context(config: RunConfig, shape: ModelShape, run: RunShape, usable: int, ranks: int) -> int | None:
    """The largest ``agent.max_context`` (from 64 tokens) under which the train rank fits."""
    assert config.agent is not None

    def fits(context: int) -> bool:
        prompt, response = agent_split(context, config.data.max_prompt_tokens)
        shorter = replace(run, prompt_tokens=prompt, response_tokens=response)
        return fit_train(shape, train_setup(config, shorter), usable, ranks)[0] is not None

    return largest_that_fits(fits, 64, config.agent.max_context)


def rollout_fixes(shape: ModelShape, setup: RolloutSetup, usable: int, limit: int) -> list[str]:
    fixes = []
    tp, _ = fit_rollout(shape, setup, usable, SIZES[-1])
    if tp is not None and tp > limit:
        fixes.append(f"a tensor-parallel size of {tp} (more GPUs per engine)")
    widest = (_sizes(limit, shape.heads) or [1])[-1]
    most = max_concurrency(shape, setup, usable, widest)
    if most >= 1:
        fixes.append(f"rollout.max_batch_size={most} (fewer sequences' KV cache at once)")
    return fixes or ["a GPU with more memory: the weights alone do not fit"]
