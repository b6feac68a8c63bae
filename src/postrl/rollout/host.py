"""A rollout engine in its own process (a child process or a Ray actor): builds the engine from
the config and adds what a remote engine needs, receiving weights from a broadcast group."""

from __future__ import annotations

from typing import Any

import torch

from postrl.config.run import RolloutConfig
from postrl.rollout.broadcast import BroadcastPlan, receive_state
from postrl.types import Prompt, Rollout, SamplingParams

# the calls a hosted engine takes beside a generate in progress (it orders them itself: new weights
# wait for its next decode step, a suspend stops the generate there)
ENGINE_SIDE_CALLS = frozenset({"update_weights", "receive_broadcast", "suspend"})


class RolloutEngineHost:
    def __init__(
        self,
        config: RolloutConfig,
        model_path: str,
        model_dtype: str,
        seed: int,
        threads: int | None = None,
        adapter_rank: int | None = None,
    ) -> None:
        from postrl.models.loading import load_tokenizer, quiet_transformers
        from postrl.rollout.factory import make_rollout_worker

        quiet_transformers()
        if threads:
            torch.set_num_threads(threads)
        self.engine = make_rollout_worker(
            config, model_path, load_tokenizer(model_path), model_dtype, seed, adapter_rank
        )

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def version(self) -> int:
        return self.engine.weight_version

    def generate(
        self, prompts: list[Prompt], sampling_params: SamplingParams, weight_version: int | None
    ) -> list[Rollout]:
        return self.engine.generate(prompts, sampling_params, weight_version)

    def update_weights(self, weights: Any, version: int, manifest: dict[str, str] | None = None) -> int:
        self.engine.update_weights(weights, version, manifest)
        return version

    def suspend(self) -> bool:
        return self.engine.suspend()

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
        self.engine.update_weights(state, version, manifest)
        return version

    def health_check(self) -> Any:
        return self.engine.health_check()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

    def close(self) -> None:
        self.engine.close()
