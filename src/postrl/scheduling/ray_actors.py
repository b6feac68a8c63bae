"""A worker as a Ray actor: :class:`ActorHost` builds the worker class inside the actor and calls its
methods by name; :class:`RayHandle` is the driver's side, with the same interface as a local
handle (typed remote errors, timeouts, liveness, a bounded close)."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from postrl.workers.errors import RemoteFailure, WorkerCallError
from postrl.workers.handles import (
    WorkerDiedError,
    WorkerTimeoutError,
    member_of,
    methods_of,
    submit,
)
from postrl.workers.wire import pack, unpack


class ActorHost:
    """Runs inside a Ray actor: ``factory(*args, **kwargs)``, then its methods by name."""

    def __init__(self, factory: Any, args: tuple, kwargs: dict, threads: int | None) -> None:
        import torch

        from postrl.models.host_memory import keep_freed_memory

        keep_freed_memory()
        torch.set_num_threads(threads or os.cpu_count() or 1)
        self.obj = factory(*args, **kwargs)

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple[str, Any]:
        """("ok", the packed result), or ("error", a RemoteFailure) when the method raised."""
        try:
            return "ok", pack(member_of(self.obj, method)(*unpack(args), **unpack(kwargs)))
        except Exception as exc:  # noqa: BLE001 - sent back typed, raised again on the caller's side
            return "error", RemoteFailure.of(exc)

    def attribute(self, name: str) -> Any:
        return member_of(self.obj, name)

    def methods(self) -> frozenset[str]:
        return methods_of(self.obj)

    def ping(self) -> bool:
        return True


def rendezvous_address() -> tuple[str, int]:
    """An address and a free port on the node this runs on (for rank 0 of a train group)."""
    import ray

    from postrl.workers.net import free_port

    host = ray.util.get_node_ip_address()
    return host, free_port(host if host != "127.0.0.1" else "127.0.0.1")


class RayHandle:
    def __init__(self, name: str, actor: Any, concurrent: bool = False) -> None:
        """``concurrent``: the actor is threaded (``max_concurrency`` > 1) and its worker orders its
        own calls, so a call may run beside one in progress (weights arriving during a generate)."""
        self.name = name
        self.actor = actor
        self.concurrent = concurrent
        self.in_process = False
        self._killed = False

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        import ray

        if self._killed:
            raise WorkerDiedError(f"{self.name} was stopped")
        try:
            status, value = ray.get(self.actor.call.remote(method, pack(args), pack(kwargs)), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerTimeoutError(f"{self.name} did not answer {method} within {timeout:g} s") from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(f"{self.name} died during {method}: {str(exc).splitlines()[0]}") from None
        except ray.exceptions.RayTaskError as exc:
            raise WorkerCallError(f"{self.name} failed in {method}: {exc}") from None
        if status == "error":
            raise value.error(self.name, method)
        return unpack(value)

    def call_async(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Future:
        return submit(self.call, method, *args, timeout=timeout, **kwargs)

    def runs_beside(self, method: str) -> bool:
        return self.concurrent

    def attribute(self, name: str) -> Any:
        import ray

        return ray.get(self.actor.attribute.remote(name), timeout=60)

    def methods(self) -> frozenset[str]:
        import ray

        return ray.get(self.actor.methods.remote(), timeout=60)

    def alive(self) -> bool:
        import ray

        if self._killed:
            return False
        try:
            return ray.get(self.actor.ping.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def kill(self) -> None:
        import ray

        if not self._killed:
            self._killed = True
            if ray.is_initialized():  # after shutdown the actor is gone (and ray.kill would start a new Ray)
                ray.kill(self.actor, no_restart=True)

    def close(self, timeout: float = 30.0) -> None:
        if not self._killed:
            try:
                self.call("close", timeout=timeout)
            except (WorkerDiedError, WorkerTimeoutError, WorkerCallError):
                pass  # it is killed below either way
        self.kill()
