"""What both schedulers share: the rollout pool around their engine handles, and the weight transport."""

from __future__ import annotations

from collections.abc import Callable

from postrl.config.run import RunConfig
from postrl.rollout.pool import RolloutPool
from postrl.rollout.weight_transport import BroadcastTransport, DirectTransport, WeightTransport
from postrl.workers.handles import Handle


def make_transport(config: RunConfig, host: str = "127.0.0.1") -> WeightTransport:
    timeout = config.scheduler.call_timeout_s
    if config.rollout.weight_sync == "broadcast":
        return BroadcastTransport(host=host, bucket_bytes=config.rollout.sync_bucket_mb << 20, timeout_s=timeout)
    return DirectTransport(timeout_s=timeout)


def make_pool(config: RunConfig, start_engine: Callable[[int], Handle], host: str = "127.0.0.1") -> RolloutPool:
    return RolloutPool(
        start_engine,
        config.scheduler.rollout.workers,
        make_transport(config, host),
        generate_timeout_s=config.scheduler.call_timeout_s,
    )
