"""What the native engine's decode loop works on: a ``generate`` call (:class:`Request`), one
sample being generated (:class:`Sequence`), and the tokens of one pass of the model
(:class:`ForwardPass`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from postrl.rollout.stops import StopChecker
from postrl.types import Prompt, SamplingParams, TokenCallback

SamplingKey = tuple[float, int, float, int]  # what the rows sampled together must share


def sampling_key(sp: SamplingParams) -> SamplingKey:
    return (sp.temperature, sp.top_k, sp.top_p, sp.top_logprobs)


@dataclass(eq=False)
class Request:
    """One ``generate`` call in a loop: its prompts and sampling; its samples, sorted by prompt and
    sample, go to ``done`` when the last one finishes."""

    prompts: list[Prompt]
    sp: SamplingParams
    on_token: TokenCallback | None = None
    done: Future[list[tuple[Sequence, str]]] = field(default_factory=Future)
    wake: threading.Event = field(default_factory=threading.Event)  # set when answered (or to hand it the loop)
    finished: list[tuple[Sequence, str]] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # set when it joins a loop (the engine's EOS ids + its own)
    checker: StopChecker | None = None

    @property
    def samples(self) -> int:
        return len(self.prompts) * self.sp.n

    def finish(self, seq: Sequence, reason: str) -> None:
        """Record a finished sample; the request is answered with its last."""
        self.finished.append((seq, reason))
        if len(self.finished) == self.samples and not self.done.done():
            self.done.set_result(sorted(self.finished, key=lambda t: (t[0].prompt_index, t[0].sample_index)))
            self.wake.set()

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
            self.wake.set()


@dataclass
class ForwardPass:
    """Tokens for one forward of the model: their positions and cache slots, how they attend, and
    the rows whose logits are wanted (a decode step also names the slots those rows sample for)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    rows: torch.Tensor
    owners: torch.Tensor | None = None  # decode: the active slots of ``rows``
    live: torch.Tensor | None = None  # decode: which slots of the dense range are active


@dataclass
class Sequence:
    """One sample being generated: its tokens so far, with their logprobs and versions
    (``prompt_index``: the prompt's index in its request)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    request: Request
    stream: int  # its random stream (postrl.rollout.streams)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights that produced each token
    kv_versions: list[int] = field(default_factory=list)  # the oldest weights behind the cache it attended to
    cache_key: str | None = None  # kept in KeptCaches under this key when it finishes
