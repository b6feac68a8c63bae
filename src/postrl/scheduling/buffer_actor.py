"""The Experience Buffer as a Ray actor of its own (``scheduler: ray``): generation, scoring and
training reach it by handle, so each of them can move, fail or scale without taking the buffer's
contents with it. The client speaks :class:`postrl.buffer.ExperienceStore`."""

from __future__ import annotations

from typing import Any

from postrl.buffer import BufferBatch
from postrl.types import Experience
from postrl.workers.handles import Handle


class BufferClient:
    def __init__(self, handle: Handle, timeout: float | None = None) -> None:
        self.handle, self.timeout = handle, timeout

    def put(self, experiences: list[Experience]) -> None:
        self.handle.call("put", experiences, timeout=self.timeout)

    def get(self, batch_size: int | None, current_version: int) -> BufferBatch:
        return self.handle.call("get", batch_size, current_version, timeout=self.timeout)

    def state_dict(self) -> dict[str, Any]:
        return self.handle.call("state_dict", timeout=self.timeout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.handle.call("load_state_dict", state, timeout=self.timeout)

    def __len__(self) -> int:
        return int(self.handle.call("__len__", timeout=self.timeout))

    def close(self) -> None:
        self.handle.close()
