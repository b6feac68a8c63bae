"""What both schedulers share: the rollout pool around their engine handles, and the weight transport."""

from __future__ import annotations

from collections.abc import Callable

from postrl.config.run import RunConfig
from postrl.rollout.pool import RolloutPool
from postrl.rollout.weight_transport import BroadcastTransport, DirectTransport, FileTransport, WeightTransport
from postrl.workers.handles import Handle


def make_transport(config: RunConfig, host: str = "127.0.0.1") -> WeightTransport:
    """The transport of ``rollout.weight_sync``: memory, safetensors or broadcast."""
    timeout, r = config.scheduler.call_timeout_s, config.rollout
    if r.weight_sync == "broadcast":
        return BroadcastTransport(host=host, bucket_bytes=r.sync_bucket_mb << 20, timeout_s=timeout)
    if r.weight_sync == "safetensors":
        return FileTransport(r.sync_dir, timeout_s=timeout)
    return DirectTransport(timeout_s=timeout)


def make_pool(config: RunConfig, start_engine: Callable[[int], Handle], host: str = "127.0.0.1") -> RolloutPool:
    return RolloutPool(
        start_engine,
        config.scheduler.rollout.workers,
        make_transport(config, host),
        generate_timeout_s=config.scheduler.call_timeout_s,
    )
