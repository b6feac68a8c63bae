"""Reaching a Ray cluster: a bounded ``ray.init`` (Ray retries an unreachable address without end)
and the resources a placement asked for against what the cluster has."""

from __future__ import annotations

import threading
from typing import Any

from postrl.config.run import ConfigError
from postrl.workers.net import can_connect, host_port


class ClusterUnreachableError(ConfigError):
    """The Ray cluster at ``scheduler.address`` could not be reached in ``scheduler.connect_timeout_s``."""


CONNECT_THREAD = "ray-connect"


def connect_abandoned() -> bool:
    """Whether a ``ray.init`` is still running on a thread left behind at its time limit: Ray's C++
    core then aborts the process (``std::bad_alloc``) when the interpreter finalizes under it, so a
    process that stops now must leave without finalizing (``os._exit``)."""
    return any(t.name == CONNECT_THREAD and t.is_alive() for t in threading.enumerate())


def connect_ray(address: str | None, timeout_s: float, options: dict[str, Any]) -> None:
    """``ray.init`` with a bounded wait. Ray itself retries an unreachable address without end, so a
    TCP probe comes first and the connection itself runs under a watchdog."""
    import ray

    if address is None:
        # a local instance: started from this (the main) thread, since Ray ties its processes' lives
        # to the starting thread (parent-death signal), and nothing here can hang on a network
        ray.init(**options)
        return
    where = f"scheduler.address={address}"
    endpoint = host_port(address)
    if endpoint is not None:
        why = can_connect(*endpoint, timeout_s=min(timeout_s, 10.0))
        if why is not None:
            raise ClusterUnreachableError(f"cannot reach the Ray cluster at {address} ({where}): {why}")
    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=address, **options)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=init, name=CONNECT_THREAD, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ClusterUnreachableError(
            f"could not connect to the Ray cluster at {address} ({where}) within "
            f"{timeout_s:g} s (scheduler.connect_timeout_s); is a Ray head running there?"
        )
    if failure:
        raise ClusterUnreachableError(
            f"could not connect to the Ray cluster at {address} ({where}): {str(failure[0]).splitlines()[0]}"
        ) from failure[0]


def short_resources(asked: dict[str, float]) -> str:
    """Which resource the cluster lacks for ``asked`` (e.g. 'short of GPU: asked 2, the cluster has 0')."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    short = [
        f"{key}: asked {value:g}, the cluster has {total.get(key, 0.0):g} ({free.get(key, 0.0):g} free)"
        for key, value in asked.items()
        if value and value > free.get(key, 0.0)
    ]
    if short:
        return "short of " + "; ".join(short) + " (lower scheduler.*.num_cpus / num_gpus / workers, or add nodes)"
    return (
        f"the cluster has the resources ({free} free), so an actor's constructor is slow or stuck "
        "(see the Ray logs under /tmp/ray/session_latest/logs)"
    )
