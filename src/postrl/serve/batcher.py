"""Turns concurrent requests into batched ``generate`` calls on one engine.

Requests wait in a queue; a single worker thread takes everything queued, groups it by
sampling parameters and runs one ``generate`` per group, so concurrent HTTP clients share the
engine's batch instead of taking turns. The engine is only ever touched from that thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postrl.rollout.base import RolloutWorker
from postrl.types import Prompt, Rollout, SamplingParams


@dataclass
class _Job:
    kind: str  # "generate" | "update"
    payload: Any
    future: Future


class EngineBatcher:
    def __init__(self, worker: RolloutWorker, max_batch_prompts: int = 256) -> None:
        self.worker = worker
        self.max_batch_prompts = max_batch_prompts
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="postrl-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Rollout]:
        return await self._submit("generate", (prompts, params))

    async def update_weights(self, path: str | Path, version: int, manifest: dict[str, str] | None) -> None:
        await self._submit("update", (path, version, manifest))

    async def _submit(self, kind: str, payload: Any) -> Any:
        future: Future = Future()
        self._queue.put(_Job(kind, payload, future))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

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
            else:
                pending_generate.setdefault(job.payload[1], []).append(job)
        self._flush(pending_generate)

    def _flush(self, groups: dict[SamplingParams, list[_Job]]) -> None:
        for params, group in groups.items():
            prompts = [p for job in group for p in job.payload[0]]
            try:
                out = self.worker.generate(prompts, params, self.worker.weight_version)
            except Exception as exc:  # noqa: BLE001 - each waiting request gets the error
                for job in group:
                    job.future.set_exception(exc)
                continue
            start = 0
            for job in group:
                count = len(job.payload[0])
                mine = [r for r in out if start <= r.prompt_index < start + count]
                for r in mine:
                    r.prompt_index -= start
                job.future.set_result(mine)
                start += count

    @staticmethod
    def _call(job: _Job, fn) -> None:
        try:
            job.future.set_result(fn())
        except Exception as exc:  # noqa: BLE001
            job.future.set_exception(exc)
