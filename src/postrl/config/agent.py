"""Multi-turn episodes (``agent:``): the environment, the episode limits, and where rewards come from."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from postrl.config.base import Section
from postrl.config.imports import import_callable

AgentKind = Literal["env", "function", "seated"]

KIND_RUNS = {
    "env": "an agent.env run",
    "function": "an agent.function run",
    "seated": "a seated run (agent.env with agent.seats)",
}

# what each kind of run never reads, and why: set to anything but its default, it is refused by name
UNREAD: dict[str, dict[str, str]] = {
    "function": {
        "env_options": "there is no environment to make",
        "max_turns": "your function decides how many calls it makes",
        "max_tokens_per_turn": "each call's max_tokens is the request's",
        "on_turn_length": "your function sees a cut turn's finish_reason and decides",
        "scheduling": "your function's calls join the engine as they come",
        "max_concurrent_episodes": "agent.env_workers bounds the functions running at once",
        "env_timeout_s": "a whole episode is bounded by agent.function_timeout_s",
    },
    "seated": {
        "on_turn_length": "a seat's turn cut at max_tokens_per_turn goes to the environment as it is",
        "scheduling": "each game is played through the run's recording server, one thread per game",
        "max_concurrent_episodes": "agent.env_workers bounds the games played at once",
        "env_timeout_s": "a whole game is bounded by agent.function_timeout_s",
    },
    "env": {
        "function_timeout_s": "an environment's calls are bounded by agent.env_timeout_s",
    },
}


class AgentConfig(Section):
    env: str | None = Field(
        None,
        description="The environment: a registered name (calculator, tools), a library's environment "
        "(textarena:Mastermind-v0, skyrl_gym:gsm8k_multi_turn, gem:game:Mastermind-v0-easy), module:Class of your own "
        "package (reset(row) -> messages, step(action) -> StepResult, close(), tools), or the URL of postrl serve-env.",
    )
    function: str | None = Field(
        None,
        description="Instead of env: module:function of an agent written against the OpenAI API, called as "
        "function(client, row) -> reward with an openai.OpenAI client on a recording server over the run's engine.",
    )
    env_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments the environment is made with, once per episode."
    )
    max_turns: int = Field(4, ge=1, description="Model turns per episode; an episode that reaches it ends (max_turns).")
    max_tokens_per_turn: int = Field(
        128, ge=1, description="New tokens per model turn; a turn that reaches it ends its episode (length)."
    )
    on_turn_length: Literal["end", "continue"] = Field(
        "end",
        description="A turn cut at max_tokens_per_turn: end the episode (finish reason length), or hand the cut "
        "turn to the environment and go on.",
    )
    max_context: int = Field(
        2048, ge=2, description="Tokens in an episode's whole context; an episode that fills it ends (max_context)."
    )
    on_prefix_break: Literal["split", "keep_context"] = Field(
        "split",
        description="Where the chat template rewrites earlier turns: split starts a new training sample from the "
        "template's rendering; keep_context keeps the model's own tokens as the context and appends the new "
        "messages. Either way the break is counted and nothing is trained on re-tokenized text.",
    )
    reward: Literal["environment", "service"] = Field(
        "environment",
        description="environment: an episode's reward is the sum of its environment's rewards; service: the "
        "reward components score the transcript (their columns get messages and env_info).",
    )
    tools_in_prompt: Literal["template", "system", "none"] = Field(
        "template",
        description="How the model learns of the environment's tools (or of the tools an agent.function's "
        "requests offer): template passes them to the chat template (tools=; a run, or a request, whose template "
        "drops them is refused), system writes them into a system message (with the <tool_call> format) for "
        "templates that ignore tools=, as SmolLM2's does; none describes them nowhere (the model was trained on "
        "them, or the environment's messages describe them).",
    )
    scheduling: Literal["individual", "lockstep"] = Field(
        "individual",
        description="individual: each episode runs on its own, its turn goes to the engine as soon as its "
        "environment answers, and one waiting on a tool delays no other (the native engine batches the turns in "
        "flight continuously); lockstep: every turn waits for all running episodes' turns and steps their "
        "environments together. Both give the same tokens for the same seed (each episode samples from its own "
        "random stream).",
    )
    max_concurrent_episodes: int | None = Field(
        None,
        ge=1,
        description="Episodes in flight at once with scheduling: individual (None: all of a step's episodes).",
    )
    env_workers: int = Field(
        32,
        ge=1,
        description="Environment calls (or agent functions) run concurrently in this many threads; a call "
        "abandoned at its time limit frees its place.",
    )
    env_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds an environment's reset, step or close may take (a tool call inside a step counts "
        "toward its step); one that passes it ends its episode as unscorable ('environment step timed out after "
        "N s') without holding up the batch: the call is abandoned on a daemon thread.",
    )
    seats: dict[str, str] | None = Field(
        None,
        description="With policies: the seats of a seated agent.env (players of a game, roles) -> the policy that "
        "plays each (every seat a policy, each policy one seat); the environment says which seat acts at each turn "
        "(rollout/agentic/seats.py). textarena:GAME's seats are player_0, player_1, ...",
    )
    function_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds an agent.function episode may take in all; past it the episode is unscorable "
        "('agent function timed out after N s') and abandoned.",
    )

    @field_validator("env")
    @classmethod
    def _env_exists(cls, v: str | None) -> str | None:
        """``module:Class`` is imported here; a registered name or a library's environment
        (``textarena:``, ``skyrl_gym:``, ``gem:``) is checked before the run starts."""
        library = None if v is None else v.partition(":")[0].replace("-", "_")
        if library in ("textarena", "skyrl_gym", "gem"):
            return v
        if v is not None and ":" in v and not v.startswith(("http://", "https://")):
            import_callable(v, "agent.env")
        return v

    @field_validator("function")
    @classmethod
    def _function_exists(cls, v: str | None) -> str | None:
        if v is not None:
            import_callable(v, "agent.function")
        return v

    @property
    def kind(self) -> AgentKind:
        """env (episodes postrl drives), function (your OpenAI-API agent) or seated (a game of several
        policies' seats)."""
        if self.function is not None:
            return "function"
        return "env" if self.seats is None else "seated"

    @model_validator(mode="after")
    def _one_source(self) -> AgentConfig:
        if (self.env is None) == (self.function is None):
            raise ValueError("agent needs exactly one of env (an environment) and function (an OpenAI-API agent)")
        if self.seats is not None and self.env is None:
            raise ValueError("agent.seats: the seats are a seated environment's (agent.env), not an agent function's")
        if self.seats is not None and self.reward != "environment":
            raise ValueError("agent.seats: each policy's reward is its seat's, from the environment (agent.reward)")
        return self

    @model_validator(mode="after")
    def _only_what_its_kind_reads(self) -> AgentConfig:
        """A field this kind of run never reads, set to anything but its default, is refused by name
        (silently ignoring it would let a user believe it applies)."""
        for name, why in UNREAD[self.kind].items():
            if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True):
                raise ValueError(f"agent.{name} is not read by {KIND_RUNS[self.kind]}: {why} (remove it)")
        return self
