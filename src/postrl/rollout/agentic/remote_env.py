"""An environment served by ``postrl serve-env``, as the episode runner sees any environment.

``agent.env: http://host:8300`` (with ``agent.env_options: {token_env: ENV_TOKEN}`` when the
server wants a token): one episode on the server per ``RemoteEnvironment``; its tools are the
server's (their schemas reach the chat template; they run on the server)."""

from __future__ import annotations

import os
from typing import Any

import httpx

from postrl.rollout.agentic.env import StepResult
from postrl.rollout.agentic.tools import Tool
from postrl.types.episode import ToolCallRecord


class EnvironmentServiceError(RuntimeError):
    """The environment service refused a request or could not be reached."""


def _runs_on_the_server(**_: Any) -> str:
    raise EnvironmentServiceError("a remote environment's tools run on its server")


class RemoteEnvironment:
    def __init__(self, url: str, token_env: str | None = None, timeout_s: float = 60.0) -> None:
        token = os.environ.get(token_env, "") if token_env else ""
        if token_env and not token:
            raise EnvironmentServiceError(
                f"agent.env_options.token_env {token_env}: that environment variable is not set"
            )
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.tools: list[Tool] = []
        self.episode: str | None = None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EnvironmentServiceError(f"{self.client.base_url}{path}: {exc}") from None
        if response.status_code != 200:
            raise EnvironmentServiceError(f"{self.client.base_url}{path}: {response.status_code} {_detail(response)}")
        return response.json()

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        reply = self._post("/episodes", {"row": row})
        self.episode = reply["episode_id"]
        self.tools = [Tool(s["function"]["name"], _runs_on_the_server, s) for s in reply["tools"]]
        return reply["messages"]

    def state_dict(self) -> dict[str, Any]:
        """The server's saved episode, with the tools it offers: enough to go on after a restart."""
        try:
            response = self.client.get(f"/episodes/{self.episode}/state")
        except httpx.HTTPError as exc:
            raise EnvironmentServiceError(f"{self.client.base_url}: {exc}") from None
        if response.status_code != 200:
            raise EnvironmentServiceError(
                f"saving episode {self.episode}: {response.status_code} {response.text[:300]}"
            )
        return {"state": response.json()["state"], "tools": [t.schema for t in self.tools]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        reply = self._post("/episodes", {"state": state["state"]})
        self.episode = reply["episode_id"]
        self.tools = [Tool(s["function"]["name"], _runs_on_the_server, s) for s in state["tools"]]

    def step(self, action: str) -> StepResult:
        reply = self._post(f"/episodes/{self.episode}/step", {"action": action})
        calls = [ToolCallRecord(**c) for c in reply["tool_calls"]]
        return StepResult(reply["messages"], reply["reward"], reply["done"], reply["info"], calls)

    def close(self) -> None:
        if self.episode is not None:
            try:
                self.client.delete(f"/episodes/{self.episode}")
            except httpx.HTTPError:
                pass  # the server closes what it holds when it stops
            self.episode = None
        self.client.close()


def _detail(response: httpx.Response) -> str:
    """The server's JSON ``detail`` (serve-env names the environment's exception there), else the body."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail else response.text[:300]
