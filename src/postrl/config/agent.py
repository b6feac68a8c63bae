"""Multi-turn episodes (``agent:``): what plays them, their limits, and where rewards come from.

``agent:`` is one of four kinds, told apart by their keys: an environment postrl drives
(:class:`EnvAgent`, ``env``), an agent function written against the OpenAI API
(:class:`FunctionAgent`, ``function``), a seated game whose seats the run's policies play
(:class:`SeatedAgent`, ``env`` with ``seats``), or a verifiers environment that brings its own
dataset, rollout logic and rubric (:class:`VerifiersAgent`, ``verifiers``). Each kind has only the fields it reads; one it does
not read is refused by name, with the reason.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from postrl.config.base import Section
from postrl.config.imports import import_callable

AgentKind = Literal["env", "function", "seated", "verifiers"]

KIND_RUNS = {
    "env": "an agent.env run",
    "function": "an agent.function run",
    "seated": "a seated run (agent.env with agent.seats)",
    "verifiers": "an agent.verifiers run",
}

_NOT_BOTH = (
    "agent needs exactly one of env (an environment), function (an OpenAI-API agent) and verifiers (a verifiers "
    "environment)"
)
_ITS_OWN = "the verifiers environment's own rollout logic decides it"

# what each kind never reads, and why: given, it is refused by name
UNREAD: dict[str, dict[str, str]] = {
    "function": {
        "env": _NOT_BOTH,
        "seats": "the seats are a seated environment's (agent.env), not an agent function's",
        "env_options": "there is no environment to make",
        "max_turns": "your function decides how many calls it makes",
        "max_tokens_per_turn": "each call's max_tokens is the request's",
        "on_turn_length": "your function sees a cut turn's finish_reason and decides",
        "scheduling": "your function's calls join the engine as they come",
        "max_concurrent_episodes": "agent.env_workers bounds the functions running at once",
        "env_timeout_s": "a whole episode is bounded by agent.function_timeout_s",
        "mcp_servers": "your function's framework reaches MCP servers itself (its own MCP client)",
    },
    "seated": {
        "tools_in_prompt": "a seated environment offers no tools",
        "mcp_servers": "a seated environment offers no tools",
        "function_timeout_s": "a game's reset and each of its steps are bounded by agent.env_timeout_s",
    },
    "env": {
        "function_timeout_s": "an environment's calls are bounded by agent.env_timeout_s",
    },
    "verifiers": {
        "env": _NOT_BOTH,
        "function": _NOT_BOTH,
        "seats": "a verifiers environment is played by the run's one policy",
        "env_options": "the environment is made with agent.verifiers_args",
        "max_turns": _ITS_OWN + " (its max_turns: pass it in agent.verifiers_args)",
        "max_tokens_per_turn": "each model call's max_tokens is rollout.max_tokens",
        "on_turn_length": _ITS_OWN,
        "scheduling": "the environment's calls join the engine as they come",
        "max_concurrent_episodes": "agent.env_workers bounds the groups running at once",
        "env_timeout_s": "a group of rollouts is bounded by agent.group_timeout_s",
        "function_timeout_s": "a group of rollouts is bounded by agent.group_timeout_s",
        "mcp_servers": "a verifiers environment brings its own tools (an MCPEnv its own servers)",
    },
}


def reward_field() -> Any:
    """``agent.reward`` of the kinds that may score a transcript (an environment's, a function's)."""
    return Field(
        "environment",
        description="environment: an episode's reward is the sum of its environment's rewards (or what the agent "
        "function returns); service: the reward components score the transcript (their columns get messages and "
        "env_info).",
    )


def tools_in_prompt_field() -> Any:
    """``agent.tools_in_prompt`` of the kinds whose model may be offered tools."""
    return Field(
        "template",
        description="How the model learns of the environment's tools (or of the tools an agent.function's "
        "requests offer): template passes them to the chat template (tools=; a run, or a request, whose template "
        "drops them is refused), system writes them into a system message (with the <tool_call> format) for "
        "templates that ignore tools=, as SmolLM2's does; none describes them nowhere (the model was trained on "
        "them, or the environment's messages describe them).",
    )


class McpServer(Section):
    """An MCP server whose tools the model may call (``agent.mcp_servers``): a stdio subprocess or a
    streamable-HTTP endpoint (rollout/agentic/mcp_tools.py)."""

    name: str = Field(..., min_length=1, description="What errors and the tool records call this server.")
    command: list[str] | None = Field(
        None,
        min_length=1,
        description="A stdio server: the program and its arguments, started by postrl (python: the interpreter "
        "that runs postrl, with its packages).",
    )
    url: str | None = Field(None, description="A streamable-HTTP server's endpoint (http://host:port/mcp).")
    env: dict[str, str] = Field(
        default_factory=dict, description="A stdio server's environment variables (empty: MCP's default set)."
    )
    scope: Literal["run", "episode"] = Field(
        "run",
        description="run: one session for the whole run (one process of a stdio server); episode: a fresh session "
        "(and process) for every episode, ended with it.",
    )
    call_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a tool call may take; past it the episode ends as unscorable."
    )
    start_timeout_s: float = Field(30.0, gt=0, description="Seconds the server may take to start and list its tools.")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name}: give exactly one of command (stdio) and url (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.name}: url {self.url!r} is not an http(s) URL")
        if self.url is not None and self.env:
            raise ValueError(f"MCP server {self.name}: env is for a stdio server's process (command)")
        return self


class AgentBase(Section):
    """What every kind of agent run reads."""

    kind: ClassVar[AgentKind]

    max_context: int = Field(
        2048, ge=2, description="Tokens in an episode's whole context; an episode that fills it ends (max_context)."
    )
    on_prefix_break: Literal["split", "keep_context"] = Field(
        "split",
        description="Where the chat template rewrites earlier turns: split starts a new training sample from the "
        "template's rendering; keep_context keeps the model's own tokens as the context and appends the new "
        "messages. Either way the break is counted and nothing is trained on re-tokenized text.",
    )
    env_workers: int = Field(
        32,
        ge=1,
        description="Environment calls (or agent functions) run concurrently in this many threads; a call "
        "abandoned at its time limit frees its place.",
    )

    @model_validator(mode="before")
    @classmethod
    def _only_what_its_kind_reads(cls, data: Any) -> Any:
        """A field this kind of run never reads is refused by name (silently ignoring it would let a
        user believe it applies); one set to null is not given."""
        if not isinstance(data, dict):
            return data
        for name, why in UNREAD[cls.kind].items():
            if data.get(name) is not None:
                raise ValueError(f"agent.{name} is not read by {KIND_RUNS[cls.kind]}: {why} (remove it)")
        return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}


class EnvironmentEpisodes(AgentBase):
    """What the kinds whose episodes postrl drives (an environment's, a seated game's) read."""

    env: str = Field(
        ...,
        description="The environment: a registered name (calculator, tools), a library's environment "
        "(textarena:Mastermind-v0, skyrl_gym:gsm8k_multi_turn, gem:game:Mastermind-v0-easy), an OpenEnv server "
        "(openenv:http://host:port, or openenv:module:app to have postrl serve it), module:Class of your own "
        "package (reset(row) -> messages, step(action) -> StepResult, close(), tools), or the URL of postrl serve-env.",
    )
    env_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments the environment is made with, once per episode."
    )
    max_turns: int = Field(4, ge=1, description="Model turns per episode; an episode that reaches it ends (max_turns).")
    max_tokens_per_turn: int = Field(
        128, ge=1, description="New tokens per model turn; a turn that reaches it ends its episode (length)."
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
    env_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds an environment's reset, step or close may take (a tool call inside a step counts "
        "toward its step); one that passes it ends its episode as unscorable ('environment step timed out after "
        "N s') without holding up the batch: the call is abandoned on a daemon thread.",
    )
    on_turn_length: Literal["end", "continue"] = Field(
        "end",
        description="A turn cut at max_tokens_per_turn: end the episode (finish reason length), or hand the cut "
        "turn to the environment and go on.",
    )

    @model_validator(mode="before")
    @classmethod
    def _names_its_environment(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("env") is None:
            raise ValueError(_NOT_BOTH)
        return data

    @field_validator("env")
    @classmethod
    def _env_exists(cls, v: str) -> str:
        """``module:Class`` is imported here; a registered name or a library's environment
        (``textarena:``, ``skyrl_gym:``, ``gem:``) is checked before the run starts."""
        if v.partition(":")[0].replace("-", "_") in ("textarena", "skyrl_gym", "gem", "openenv"):
            return v
        if ":" in v and not v.startswith(("http://", "https://")):
            import_callable(v, "agent.env")
        return v


class EnvAgent(EnvironmentEpisodes):
    """An environment's episodes, each played by the run's one policy (``agent.env``)."""

    kind: ClassVar[AgentKind] = "env"

    reward: Literal["environment", "service"] = reward_field()
    tools_in_prompt: Literal["template", "system", "none"] = tools_in_prompt_field()
    mcp_servers: list[McpServer] = Field(
        default_factory=list,
        description="MCP servers whose tools join the environment's: listed and checked at start, rendered into the "
        "prompt with the environment's, called through the MCP client; a turn that calls one is answered by the "
        "servers (rollout/agentic/mcp_tools.py). Names must be unique.",
    )

    @field_validator("mcp_servers")
    @classmethod
    def _servers_named_once(cls, v: list[McpServer]) -> list[McpServer]:
        names = [s.name for s in v]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"two MCP servers are named {twice[0]!r}")
        return v


class SeatedAgent(EnvironmentEpisodes):
    """A game whose seats the run's policies play (``agent.env`` with ``agent.seats``), at token
    level inside the episode machinery (rollout/agentic/seated_games.py)."""

    kind: ClassVar[AgentKind] = "seated"

    seats: dict[str, str] = Field(
        ...,
        description="With policies: the seats of a seated agent.env (players of a game, roles) -> the policy that "
        "plays each (every seat a policy, each policy one seat); the environment says which seat acts at each turn "
        "(rollout/agentic/seats.py). textarena:GAME's seats are player_0, player_1, ...",
    )
    on_turn_length: Literal["end", "continue"] = Field(
        "continue",
        description="A seat's turn cut at max_tokens_per_turn: continue hands the cut turn to the game (a game "
        "judges a malformed move itself), end ends the game (finish reason length).",
    )
    reward: Literal["environment", "service"] = Field(
        "environment",
        description="environment (the only choice here): each policy's reward is the sum of the rewards the game "
        "gave its seat.",
    )

    @model_validator(mode="after")
    def _rewarded_by_the_game(self) -> SeatedAgent:
        if self.reward != "environment":
            raise ValueError("agent.seats: each policy's reward is its seat's, from the environment (agent.reward)")
        return self


class FunctionAgent(AgentBase):
    """Your agent function written against the OpenAI API (``agent.function``), its calls recorded."""

    kind: ClassVar[AgentKind] = "function"

    function: str = Field(
        ...,
        description="module:function of an agent written against the OpenAI API, called as "
        "function(client, row) -> reward with an openai.OpenAI client on a recording server over the run's engine.",
    )
    reward: Literal["environment", "service"] = reward_field()
    tools_in_prompt: Literal["template", "system", "none"] = tools_in_prompt_field()
    function_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds an agent.function episode may take in all; past it the episode is unscorable "
        "('agent function timed out after N s') and abandoned.",
    )

    @field_validator("function")
    @classmethod
    def _function_exists(cls, v: str) -> str:
        import_callable(v, "agent.function")
        return v


class VerifiersAgent(AgentBase):
    """A verifiers environment, unmodified (``agent.verifiers``): its dataset and eval split are the
    run's prompts, its rollout logic plays each episode through an OpenAI client on the run's
    recording server, its rubric scores each group (rollout/agentic/verifiers_env.py)."""

    kind: ClassVar[AgentKind] = "verifiers"

    verifiers: str = Field(
        ...,
        min_length=1,
        description="The environment: an installed environment package by its id (verifiers' own loader, "
        "vf.load_environment: my-env imports my_env), or module:function that returns a verifiers Environment.",
    )
    verifiers_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's load_environment."
    )
    reward: Literal["environment"] = Field(
        "environment",
        description="environment (the only choice): an episode's reward is the environment's rubric's, its reward "
        "functions' values its reward/<name> metrics.",
    )
    tools_in_prompt: Literal["template", "system", "none"] = tools_in_prompt_field()
    group_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds a prompt's group of rollout.n episodes and its rubric scoring may take in all; past it "
        "the group's episodes are unscorable ('verifiers group timed out after N s') and abandoned.",
    )

    @field_validator("verifiers")
    @classmethod
    def _environment_exists(cls, v: str) -> str:
        """``module:function`` is imported here, an id's package looked up (loading it runs its
        dataset code: that waits for the run's start)."""
        if ":" in v:
            import_callable(v, "agent.verifiers")
        elif (missing := missing_environment(v)) is not None:
            raise ValueError(missing)
        return v


def missing_environment(spec: str) -> str | None:
    """Why the environment id ``spec`` cannot be loaded (None: its package is installed). verifiers'
    loader imports ``my-env`` and ``owner/my-env`` as module ``my_env``."""
    import importlib.util

    module = spec.replace("-", "_").split("/")[-1]
    if importlib.util.find_spec(module) is None:
        return (
            f"agent.verifiers={spec!r}: no environment package '{module}' is installed (prime env install {spec}, or "
            "pip install its package; or give module:load_environment)"
        )
    return None


def _agent_kind(value: Any) -> str:
    """The kind an ``agent:`` section is, by its keys: verifiers, function, seats (with env), else env."""
    if isinstance(value, AgentBase):
        return value.kind
    if isinstance(value, dict) and value.get("verifiers") is not None:
        return "verifiers"
    if isinstance(value, dict) and value.get("function") is not None:
        return "function"
    return "seated" if isinstance(value, dict) and value.get("seats") is not None else "env"


AgentConfig = Annotated[
    Annotated[EnvAgent, Tag("env")]
    | Annotated[FunctionAgent, Tag("function")]
    | Annotated[SeatedAgent, Tag("seated")]
    | Annotated[VerifiersAgent, Tag("verifiers")],
    Discriminator(_agent_kind),
]
