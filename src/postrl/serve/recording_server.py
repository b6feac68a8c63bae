"""The recording server of an ``agent.function`` run: the OpenAI-compatible server over the run's
rollout engine, on loopback, in a thread of the run's process, recording every episode's calls."""

from __future__ import annotations

import threading
import time
from typing import Any

from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.serve.batcher import EngineBatcher
from postrl.serve.chat_turn import ToolsInPrompt
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from postrl.workers.net import free_port
from postrl.workers.roles import RolloutWorker

MODEL_NAME = "policy"  # what the agent's client sends as ``model``


class RecordingServer:
    """A :class:`~postrl.rollout.agentic.agent_function.RecordingEndpoint`, started."""

    def __init__(self, engine: RolloutWorker, tokenizer: Any, tools_in_prompt: ToolsInPrompt = "template") -> None:
        import uvicorn

        self._recorder = EpisodeRecorder(tokenizer)
        self.batcher = EngineBatcher(engine)
        limits = ServerLimits(max_prompts=1, max_n=16)
        app = build_app(
            self.batcher, tokenizer, MODEL_NAME, limits=limits, recorder=self._recorder, tools_in_prompt=tools_in_prompt
        )
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="postrl-agent-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.batcher.close()
                raise RuntimeError("the agent server did not start")
            time.sleep(0.02)
        self._root = f"http://127.0.0.1:{port}"

    @property
    def root(self) -> str:
        return self._root

    @property
    def recorder(self) -> EpisodeRecorder:
        return self._recorder

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.batcher.close()
