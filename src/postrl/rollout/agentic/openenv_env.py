"""``agent.env: openenv:http://host:port``: an OpenEnv environment server (``openenv-core``), unmodified.

Each episode opens its own session through OpenEnv's own client (``GenericEnvClient``: a WebSocket
session per client, actions and observations as JSON): ``reset`` starts the episode, each model
turn is one ``step`` whose action is ``{action_field: the turn's text}``, and the episode ends on
the server's ``done``. The step's reward is the turn's reward (summed over the episode, as every
environment's). An observation is shown to the model as a user message: ``observation_field``
where named, else the one text field the observation has, else its fields as JSON (``done``,
``reward`` and ``metadata`` left out).

``env_options``:
- ``action_field``: the action's field that carries the text (default: the one text field of the
  server's action schema, read from ``/schema`` when the episode starts);
- ``observation_field``: the observation's field shown to the model;
- ``reset_columns``: the row's columns passed to ``reset`` as keyword arguments (``[seed]``);
- ``message_timeout_s``: how long one reply may take (the run's ``env_timeout_s`` bounds it too).

A server where nothing listens, one that does not answer in time, and a reply without an
observation each end the episode as unscorable with the reason (``env_error``), never the run.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from postrl.rollout.agentic.env import StepResult, first_messages
from postrl.rollout.agentic.tools import Tool

HIDDEN = ("done", "reward", "metadata")  # an observation's fields the model is not shown


def text_fields(schema: dict[str, Any]) -> list[str]:
    """The string fields of a pydantic model's JSON schema, but for ``metadata``."""
    return [n for n, p in schema.get("properties", {}).items() if p.get("type") == "string" and n not in HIDDEN]


class OpenEnvEnvironment:
    """One episode on an OpenEnv server, through OpenEnv's own client."""

    tools: list[Tool] = []

    def __init__(
        self,
        url: str,
        action_field: str | None = None,
        observation_field: str | None = None,
        reset_columns: list[str] | None = None,
        message_timeout_s: float = 60.0,
    ) -> None:
        from openenv.core import GenericEnvClient

        self.url = url.rstrip("/")
        self.action_field = action_field
        self.observation_field = observation_field
        self.reset_columns = list(reset_columns or [])
        self.client = GenericEnvClient(base_url=self.url, message_timeout_s=message_timeout_s).sync()

    def _action_field(self) -> str:
        if self.action_field is not None:
            return self.action_field
        schema = httpx.get(f"{self.url}/schema", timeout=30).raise_for_status().json()["action"]
        fields = text_fields(schema)
        if len(fields) != 1:
            raise ValueError(
                f"OpenEnv server {self.url}: its action has text fields {fields}; name the one the model's turn "
                "fills with agent.env_options.action_field"
            )
        self.action_field = fields[0]
        return self.action_field

    def render(self, observation: Any) -> str:
        """What the model is shown of an observation."""
        if not isinstance(observation, dict):
            raise ValueError(f"OpenEnv server {self.url}: a reply's observation is {type(observation).__name__}")
        shown = {k: v for k, v in observation.items() if k not in HIDDEN and v not in ("", None)}
        if not shown:
            raise ValueError(f"OpenEnv server {self.url}: a reply without an observation to show")
        if self.observation_field is not None:
            if self.observation_field not in shown:
                raise ValueError(
                    f"OpenEnv server {self.url}: its observation has no field {self.observation_field!r} "
                    f"(fields: {sorted(shown)}; agent.env_options.observation_field)"
                )
            return str(shown[self.observation_field])
        texts = [v for v in shown.values() if isinstance(v, str)]
        return texts[0] if len(texts) == 1 and len(shown) == 1 else json.dumps(shown)

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self._action_field()
        missing = [c for c in self.reset_columns if c not in row]
        if missing:
            raise ValueError(f"agent.env_options.reset_columns: the row has no column {missing[0]!r}")
        from websockets.exceptions import ConnectionClosed

        try:
            result = self.client.reset(**{c: row[c] for c in self.reset_columns})
        except ConnectionClosed as exc:  # how an OpenEnv server at capacity ends a new session
            raise ConnectionError(
                f"OpenEnv server {self.url} closed the session at reset: a server at its max_concurrent_envs does "
                "(run at most that many episodes at once: agent.max_concurrent_episodes)"
            ) from exc
        messages = first_messages(row) if row.get("messages") or row.get("prompt") else []
        return [*messages, {"role": "user", "content": self.render(result.observation)}]

    def step(self, action: str) -> StepResult:
        result = self.client.step({self._action_field(): action})
        reward = None if result.reward is None else float(result.reward)
        if result.done:
            return StepResult([], reward=reward, done=True)
        return StepResult([{"role": "user", "content": self.render(result.observation)}], reward=reward)

    def close(self) -> None:
        self.client.close()
