"""A rollout engine in its own process (a child process or a Ray actor): the host builds the engine
from its :class:`~postrl.rollout.factory.EngineSpec` and adds what only a remote engine needs,
receiving weights from a broadcast group; every other call goes to the engine itself."""

from __future__ import annotations

from postrl.rollout.broadcast import BroadcastPlan, receive_state
from postrl.rollout.factory import EngineSpec
from postrl.workers.handles import WorkerHost
from postrl.workers.roles import RolloutWorker

# the calls a hosted engine takes beside a generate in progress (it orders them itself: new weights
# wait for its next decode step, a suspend stops the generate there, its counters are read beside it)
ENGINE_SIDE_CALLS = frozenset({"update_weights", "receive_broadcast", "suspend", "counters"})


class RolloutEngineHost(WorkerHost):
    def __init__(self, spec: EngineSpec) -> None:
        from postrl.models.loading import quiet_transformers

        quiet_transformers()
        self.target: RolloutWorker = spec.build()

    def receive_broadcast(
        self,
        host: str,
        port: int,
        rank: int,
        world: int,
        plan: BroadcastPlan,
        version: int,
        manifest: dict[str, str] | None,
        timeout_s: float,
    ) -> int:
        """Receive the whole state, verify it, then swap it in; on any failure the engine keeps
        serving the version it had."""
        state = receive_state(host, port, rank, world, plan, timeout_s)
        self.target.update_weights(state, version, manifest)
        return version
