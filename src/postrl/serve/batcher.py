"""Turns concurrent requests into batched ``generate`` calls on one engine.

Requests wait in a queue; a single worker thread takes everything queued, groups it by
sampling parameters and runs one ``generate`` per group, so concurrent HTTP clients share the
engine's batch instead of taking turns. For an engine that joins concurrent calls into its running
batch (``RolloutWorker.joins_calls``: the native engine) each group is handed to a thread of its
own and the next requests go out at once, so a request never waits for another's answer (an
agent's turn for the slowest of the turns sent with it); otherwise the engine is only ever touched
from the worker thread, one group after another.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.rollout.common import replay_tokens
from postrl.types import Prompt, Rollout, SamplingParams, TokenCallback
from postrl.workers.roles import RolloutWorker


@dataclass
class _Job:
    kind: str  # "generate" | "update" | "score"
    payload: Any
    future: Future
    on_token: TokenCallback | None = None  # called on the engine thread, with this job's prompt indices


class EngineBatcher:
    def __init__(self, worker: RolloutWorker, max_batch_prompts: int = 256) -> None:
        self.worker = worker
        self.max_batch_prompts = max_batch_prompts
        # engines that report tokens as they go stream them; others stream each response when it is done
        self.streams_tokens = worker.streams_tokens
        self._calls: ThreadPoolExecutor | None = None
        if worker.joins_calls:  # each group on a thread of its own, with the creator's torch threads
            threads = torch.get_num_threads()
            self._calls = ThreadPoolExecutor(
                max_batch_prompts, "postrl-engine-call", initializer=torch.set_num_threads, initargs=(threads,)
            )
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="postrl-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, prompts: list[Prompt], params: SamplingParams, on_token: Callable[..., None] | None = None
    ) -> list[Rollout]:
        """Rollouts for ``prompts``. ``on_token(prompt_index, sample_index, token, logprob, top, finish)``
        runs on the caller's event loop for every token (all of them at the end, for engines that do
        not stream), always before this call returns."""
        relay = None
        if on_token is not None:
            loop = asyncio.get_running_loop()

            def relay(*event: Any) -> None:
                loop.call_soon_threadsafe(on_token, *event)

        return await self._submit("generate", (prompts, params), relay)

    async def update_weights(self, path: str | Path, version: int, manifest: dict[str, str] | None) -> None:
        await self._submit("update", (path, version, manifest))

    async def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's logprob of every token after its first, under the weights of the moment
        (in queue order with the updates: a score queued after an update uses its weights)."""
        return await self._submit("score", sequences)

    async def _submit(self, kind: str, payload: Any, on_token: TokenCallback | None = None) -> Any:
        future: Future = Future()
        self._queue.put(_Job(kind, payload, future, on_token))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        if self._calls is not None:
            self._calls.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while len(jobs) < self.max_batch_prompts:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                jobs.append(nxt)
            self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        pending_generate: dict[SamplingParams, list[_Job]] = {}
        for job in jobs:
            if job.kind == "update":
                self._flush(pending_generate)  # generations queued before an update use the old weights
                pending_generate = {}
                self._call(job, lambda p=job.payload: self.worker.update_weights(p[0], p[1], p[2]))
            elif job.kind == "score":
                self._call(job, lambda p=job.payload: self.worker.prompt_logprobs(p))
            else:
                pending_generate.setdefault(job.payload[1], []).append(job)
        self._flush(pending_generate)

    def _flush(self, groups: dict[SamplingParams, list[_Job]]) -> None:
        for params, group in groups.items():
            if self._calls is not None:
                self._calls.submit(self._generate, params, group)
            else:
                self._generate(params, group)

    def _generate(self, params: SamplingParams, group: list[_Job]) -> None:
        """One ``generate`` for the group's prompts; each job gets its own rollouts (or the error)."""
        prompts = [p for job in group for p in job.payload[0]]
        owners: list[tuple[_Job, int]] = []  # merged prompt index -> (job, its first index)
        start = 0
        for job in group:
            owners += [(job, start)] * len(job.payload[0])
            start += len(job.payload[0])
        streaming = [job for job in group if job.on_token is not None]
        kwargs: dict[str, Any] = {}
        if streaming and self.streams_tokens:

            def on_token(prompt_index: int, *rest: Any, owners: list[tuple[_Job, int]] = owners) -> None:
                job, first = owners[prompt_index]
                if job.on_token is not None:
                    job.on_token(prompt_index - first, *rest)

            kwargs["on_token"] = on_token
        try:
            out = self.worker.generate(prompts, params, self.worker.weight_version, **kwargs)
        except Exception as exc:  # noqa: BLE001 - each waiting request gets the error
            for job in group:
                job.future.set_exception(exc)
            return
        per_job: dict[int, list[Rollout]] = {id(job): [] for job in group}
        for r in out:
            job, first = owners[r.prompt_index]
            r.prompt_index -= first
            per_job[id(job)].append(r)
        for job in group:
            mine = per_job[id(job)]
            if job.on_token is not None and not self.streams_tokens:
                replay_tokens(job.on_token, mine)
            job.future.set_result(mine)

    @staticmethod
    def _call(job: _Job, fn) -> None:
        try:
            job.future.set_result(fn())
        except Exception as exc:  # noqa: BLE001
            job.future.set_exception(exc)
