"""``agent.function``: train an agent written against the OpenAI API.

The run starts an OpenAI-compatible server on loopback over its own rollout engine, recording
every episode (:mod:`postrl.rollout.agentic.recorder`). For each prompt it runs the user's
``function(client, row) -> reward`` ``n`` times in threads, each with an ``openai.OpenAI`` client
whose calls carry the episode's id; the recorded, token-exact trajectories are the batch. The
function's return value is the episode's reward (None: the reward service scores the transcript).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.env import import_callable
from postrl.rollout.agentic.recorder import EpisodeRecorder, RecordedEpisode
from postrl.rollout.base import RolloutWorker
from postrl.serve.batcher import EngineBatcher
from postrl.serve.openai_server import ServerLimits, build_app
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.workers.net import free_port

log = logging.getLogger(__name__)
AgentFunction = Callable[[Any, dict[str, Any]], "float | None"]
MODEL_NAME = "policy"  # what the agent's client sends as ``model``


def load_agent_function(spec: str) -> AgentFunction:
    return import_callable(spec, "agent.function")


class RecordedAgents:
    def __init__(self, engine: RolloutWorker, tokenizer: Any, function: AgentFunction, workers: int = 8) -> None:
        import uvicorn

        self.function, self.workers = function, workers
        self.renderer = ChatRenderer(tokenizer)
        self.recorder = EpisodeRecorder(tokenizer)
        self.batcher = EngineBatcher(engine)
        limits = ServerLimits(max_prompts=1, max_n=1)
        app = build_app(self.batcher, tokenizer, MODEL_NAME, limits=limits, recorder=self.recorder)
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="postrl-agent-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the agent server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}/v1"

    def run(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        jobs = [(i, p, f"{uuid.uuid4().hex[:12]}-{i}-{k}") for i, p in enumerate(prompts) for k in range(sampling.n)]
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="postrl-agent") as pool:
            done = list(pool.map(lambda job: self._episode(*job), jobs))
        silent = sum(not rollouts for rollouts in done)
        if silent:
            log.warning("%d of %d agent episodes made no model call: nothing of them is trained on", silent, len(done))
        return [r for rollouts in done for r in rollouts]

    def _episode(self, index: int, prompt: Prompt, episode: str) -> list[Rollout]:
        import openai

        client = openai.OpenAI(
            base_url=self.url, api_key="postrl", default_headers={"X-Episode-Id": episode}, max_retries=0
        )
        row = {**prompt.columns, "prompt": prompt.text, "messages": prompt.messages}
        error = None
        try:
            reward = self.function(client, row)
        except Exception as exc:  # the agent's failure ends its episode (env_error), not the batch
            reward, error = None, f"{type(exc).__name__}: {exc}"
        finally:
            client.close()
        recorded = self.recorder.take(episode) or RecordedEpisode()
        if error is not None:
            recorded.finish_reason = "env_error"
        rollouts = recorded.rollouts(index, self.renderer, None if reward is None else float(reward))
        for r in rollouts:
            assert r.episode is not None
            if error is not None:
                r.episode.info["env_error"] = error
        return rollouts

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.batcher.close()
