"""The recording server of an ``agent.function`` run: the OpenAI-compatible server over the run's
rollout engine, on loopback, in a thread of the run's process, recording every episode's calls.

A run with several policies (``policies:``) serves each policy's engine with its own app and
recorder behind one address (:class:`~postrl.serve.policy_router.PolicyRouter`): a call reaches a
policy by its ``model`` name or its base URL, and each (episode, policy) is recorded apart, so a
policy's samples hold its own turns only."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.serve.batcher import EngineBatcher
from postrl.serve.chat_turn import ToolsInPrompt
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from postrl.serve.policy_router import PolicyRouter
from postrl.workers.net import free_port
from postrl.workers.roles import RolloutWorker

MODEL_NAME = "policy"  # what the agent's client sends as ``model`` in a run with one policy


@dataclass(frozen=True)
class ServedPolicy:
    """A policy the server answers for: its engine and its tokenizer."""

    engine: RolloutWorker
    tokenizer: Any


class RecordingServer:
    """A :class:`~postrl.rollout.agentic.agent_function.RecordingEndpoint`, started: several policies
    by name (``RecordingServer(policies)``), or one policy's engine (:meth:`of_engine`)."""

    def __init__(
        self,
        policies: Mapping[str, ServedPolicy],
        tools_in_prompt: ToolsInPrompt = "template",
        max_context: int | None = None,
    ) -> None:
        """``max_context``: a call whose prompt and max_tokens pass it is refused (400,
        ``context_length_exceeded``, as OpenAI's servers do); None: the engine's limits only."""
        self._start(policies, tools_in_prompt, max_context)

    @classmethod
    def of_engine(
        cls,
        engine: RolloutWorker,
        tokenizer: Any,
        tools_in_prompt: ToolsInPrompt = "template",
        max_context: int | None = None,
    ) -> RecordingServer:
        """One policy: calls that name no model (or any) go to ``engine``."""
        return cls({MODEL_NAME: ServedPolicy(engine, tokenizer)}, tools_in_prompt, max_context)

    def _start(
        self, policies: Mapping[str, ServedPolicy], tools_in_prompt: ToolsInPrompt, max_context: int | None
    ) -> None:
        import uvicorn

        limits = ServerLimits(max_prompts=1, max_n=16)
        self._recorders = {name: EpisodeRecorder(p.tokenizer) for name, p in policies.items()}
        self.batchers = {name: EngineBatcher(p.engine) for name, p in policies.items()}
        apps = {
            name: build_app(
                self.batchers[name],
                p.tokenizer,
                name,
                max_context=max_context,
                limits=limits,
                recorder=self._recorders[name],
                tools_in_prompt=tools_in_prompt,
            )
            for name, p in policies.items()
        }
        app = apps[MODEL_NAME] if list(apps) == [MODEL_NAME] else PolicyRouter(apps, limits.max_body_bytes)
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="postrl-agent-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self._close_batchers()
                raise RuntimeError("the agent server did not start")
            time.sleep(0.02)
        self._root = f"http://127.0.0.1:{port}"

    @property
    def root(self) -> str:
        return self._root

    @property
    def recorders(self) -> dict[str, EpisodeRecorder]:
        """Each policy's recorder, by name (``policy`` alone in a run with one)."""
        return self._recorders

    def policy_root(self, name: str) -> str:
        """Where a policy's own app answers (every path under it reaches that policy)."""
        return self._root if list(self._recorders) == [MODEL_NAME] else f"{self._root}/policies/{name}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self._close_batchers()

    def _close_batchers(self) -> None:
        for batcher in self.batchers.values():
            batcher.close()
