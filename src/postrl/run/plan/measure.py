"""What the planner is checked against: the peak bytes of live tensors while a role runs one step.

:class:`TensorBytes` is the CPU counterpart of ``torch.cuda.max_memory_allocated``: a dispatch
mode that sees every tensor an operator returns (the forward's, autograd's backward's and the
optimizer's) and counts each storage once while it is alive; tensors that exist before it starts
(the parameters) are added with :meth:`TensorBytes.hold`. It does not count the allocator's
rounding or reserve, nor memory a kernel takes for itself outside tensors (oneDNN scratch), nor
Python objects: the process's resident size is larger by the runtime's few hundred MB.
On CUDA the measurement is ``torch.cuda.max_memory_allocated`` itself.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorBytes(TorchDispatchMode):
    """``with TensorBytes() as t: ...`` then ``t.peak`` (bytes); ``t.live`` is the current sum."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}

    def hold(self, tensors: Any) -> None:
        """Count tensors that already exist (parameters, buffers, optimizer state)."""
        for value in tree_flatten(tensors)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" or tensor.is_sparse:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out


@dataclass(frozen=True)
class StepShape:
    """The shape of one step a role is measured on: prompts of ``prompt_tokens`` each, ``n``
    responses of ``response_tokens`` each (every sample at full length: the planner's worst case)."""

    prompts: int
    n: int
    prompt_tokens: int
    response_tokens: int


def synthetic_experiences(shape: StepShape, vocab: int, seed: int = 0) -> list:
    """A step's worth of samples with random tokens and advantages (shapes are what memory sees)."""
    from postrl.types import Experience

    rng = random.Random(seed)
    out = []
    for g in range(shape.prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(shape.prompt_tokens)]
        for _ in range(shape.n):
            response = [rng.randrange(3, vocab) for _ in range(shape.response_tokens)]
            out.append(Experience(prompt, response, [-1.0] * len(response), 0.0, rng.uniform(-1, 1), 0, group_id=g))
    return out


def measure_train_step(worker: Any, shape: StepShape, vocab: int, pad_id: int) -> int:
    """Peak tensor bytes of the trainer's second update on a full-length step (the first creates
    the optimizer state, which the second holds from its start)."""
    from postrl.types import ExperienceBatch

    batch = ExperienceBatch.from_experiences(synthetic_experiences(shape, vocab), pad_id)
    worker.update(batch)
    device = next(worker.model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        worker.update(batch)
        return int(torch.cuda.max_memory_allocated(device))
    with TensorBytes() as counter:
        counter.hold(
            [
                list(worker.model.parameters()),
                list(worker.model.buffers()),
                list(worker.optimization.optimizer.state.values()),
            ]
        )
        counter.hold(batch.__dict__)
        if worker.ref_model is not None:
            counter.hold(list(worker.ref_model.parameters()))
        counter.reset_peak()
        worker.update(batch)
    return counter.peak


def measure_rollout_step(worker: Any, shape: StepShape, vocab: int) -> int:
    """Peak tensor bytes of a native engine generating one step (prompts of ``prompt_tokens``, ``n``
    samples each of up to ``response_tokens``): its weights, its KV cache and the decode's work."""
    from postrl.types import Prompt, SamplingParams

    rng = random.Random(0)
    prompts = [Prompt("", [rng.randrange(3, vocab) for _ in range(shape.prompt_tokens)]) for _ in range(shape.prompts)]
    params = SamplingParams(n=shape.n, max_tokens=shape.response_tokens, seed=0)
    device = worker.model.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        worker.generate(prompts, params, None)
        return int(torch.cuda.max_memory_allocated(device))
    with TensorBytes() as counter:
        counter.hold(worker.model.held())
        counter.reset_peak()
        worker.generate(prompts, params, None)
    return counter.peak


@dataclass(frozen=True)
class MeasuredCase:
    """One run config's planned and measured peaks (bytes) for the train rank and the rollout engine."""

    name: str
    train_planned: int
    train_measured: int
    rollout_planned: int
    rollout_measured: int

    @property
    def errors(self) -> dict[str, float]:
        return {
            "train": self.train_planned / self.train_measured - 1,
            "rollout": self.rollout_planned / self.rollout_measured - 1,
        }

    def to_dict(self) -> dict[str, Any]:
        mb = lambda b: round(b / 2**20, 2)  # noqa: E731
        return {
            "name": self.name,
            "train_planned_mb": mb(self.train_planned),
            "train_measured_mb": mb(self.train_measured),
            "rollout_planned_mb": mb(self.rollout_planned),
            "rollout_measured_mb": mb(self.rollout_measured),
            "rel_error": {k: round(v, 4) for k, v in self.errors.items()},
        }


def plan_vocab(path: str) -> int:
    from postrl.run.plan.shape import load_shape

    return load_shape(path).vocab


def measure_case(name: str, config: Any, device: str = "cpu") -> MeasuredCase:
    """Plan ``config`` for this CPU, then run its train rank's update and its engine's generation on
    a full-length step (``data.max_prompt_tokens`` long prompts, ``rollout.max_tokens`` long responses)
    and compare. ``config.data.max_prompt_tokens`` must be set: it is the prompts' length."""
    from postrl.models.loading import load_tokenizer
    from postrl.models.numerics import resolve_numerics
    from postrl.rollout.factory import make_rollout_worker
    from postrl.run.plan.check import cpu_target, cuda_target
    from postrl.run.plan.planner import make_plan
    from postrl.train.factory import PolicySpec, build_train_worker

    if config.data.max_prompt_tokens is None:
        raise ValueError("measure_case needs data.max_prompt_tokens: the length of the measured prompts")
    where = torch.device(device)
    plan = make_plan(config, cuda_target(where) if where.type == "cuda" else cpu_target(), gpus=1)
    shape = StepShape(
        config.prompts_per_step, config.rollout.n, config.data.max_prompt_tokens, config.rollout.max_tokens
    )
    tokenizer = load_tokenizer(config.model.path)
    torch.manual_seed(config.seed)
    worker = build_train_worker(PolicySpec.of_run(config, resolve_numerics(config)), where)
    vocab = int(plan_vocab(config.model.path))
    train = measure_train_step(worker, shape, vocab, tokenizer.pad_token_id or 0)
    worker.close()
    del worker
    if where.type == "cuda":
        torch.cuda.empty_cache()
    engine = make_rollout_worker(config.rollout, config.model.path, tokenizer, config.model.dtype, config.seed)
    rollout = measure_rollout_step(engine, shape, vocab)
    engine.close()
    return MeasuredCase(name, plan.role("train rank").total, train, plan.role("rollout engine").total, rollout)
