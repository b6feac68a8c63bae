"""What both schedulers share: the rollout pool around their engine handles, and the weight transport."""

from __future__ import annotations

from collections.abc import Callable

from postrl.config.rollout import RolloutConfig
from postrl.config.scheduler import SchedulerConfig
from postrl.rollout.pool import RolloutPool
from postrl.rollout.weight_transport import BroadcastTransport, DirectTransport, FileTransport, WeightTransport
from postrl.workers.handles import Handle


def make_transport(rollout: RolloutConfig, timeout: float, host: str = "127.0.0.1") -> WeightTransport:
    """The transport of ``rollout.weight_sync``: memory, safetensors or broadcast."""
    if rollout.weight_sync == "broadcast":
        return BroadcastTransport(host=host, bucket_bytes=rollout.sync_bucket_mb << 20, timeout_s=timeout)
    if rollout.weight_sync == "safetensors":
        return FileTransport(rollout.sync_dir, timeout_s=timeout)
    return DirectTransport(timeout_s=timeout)


def make_pool(
    rollout: RolloutConfig, scheduler: SchedulerConfig, start_engine: Callable[[int], Handle], host: str = "127.0.0.1"
) -> RolloutPool:
    timeout = scheduler.call_timeout_s
    return RolloutPool(
        start_engine, scheduler.rollout.workers, make_transport(rollout, timeout, host), generate_timeout_s=timeout
    )
