"""A user's environments and agents that fail in every way issue 31 lists, for the tests and for
``benchmarks/fault_paths.py --agent``. Each answers a row ``{"prompt", "secret"}``: the episode's
reward is 1 when the model's turn contains the secret."""

from __future__ import annotations

import random
import threading
import time

from postrl.rollout.agentic.env import StepResult
from postrl.rollout.agentic.tools import Tool, ToolBox

HANG = threading.Event()  # set: every hanging call returns (tests let their threads go at the end)


def _hang() -> None:
    HANG.wait(3600)


class GuessNumber:
    """The well-behaved one: one turn, rewarded by whether the secret is in it."""

    tools: list[Tool] = []

    def reset(self, row):
        self.secret = str(row["secret"])
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        return StepResult([], reward=float(self.secret in action), done=True)

    def close(self):
        pass


class Introduced(GuessNumber):
    """Its first observation is not the row's prompt (as a game's is not "play")."""

    def reset(self, row):
        self.secret = str(row["secret"])
        return [
            {"role": "system", "content": "You play a game."},
            {"role": "user", "content": f"Guess: {row['prompt']}"},
        ]


class TwoTurns(GuessNumber):
    """Two turns: asks again after the first answer, then ends with reward 1 on rows whose secret is
    even, when both turns ended at the end of a turn (no end-of-turn token or later text in them)."""

    def reset(self, row):
        self.secret, self.actions = row["secret"], []
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.actions.append(action)
        if len(self.actions) == 1:
            return StepResult([{"role": "user", "content": "Once more."}])
        clean = all("<|im_end|>" not in a and "<|im_start|>" not in a for a in self.actions)
        return StepResult([], reward=float(self.secret % 2 == 0 and clean), done=True)


class SomeResetsRaise(GuessNumber):
    """The reset of every fourth row (secret divisible by 4) raises."""

    def reset(self, row):
        if row["secret"] % 4 == 0:
            raise RuntimeError(f"no level {row['secret']}")
        return super().reset(row)


def _add(a: int, b: int) -> int:
    return a + b


class BadSchemaTools(GuessNumber):
    """A custom environment whose hand-written tool schema is not JSON Schema."""

    tools = [Tool("add", _add, {"type": "function", "function": {"name": "add", "parameters": {"type": "objekt"}}})]


class TwinTools(GuessNumber):
    tools = [Tool.from_function(_add, "add"), Tool.from_function(_add, "add")]


class CloseRaises(GuessNumber):
    def close(self):
        raise OSError("the socket is gone")


class ResetRaises(GuessNumber):
    def reset(self, row):
        raise RuntimeError("the maze file is missing")


class StepRaises(GuessNumber):
    def step(self, action):
        raise KeyError("score table")


class StepReturnsStr(GuessNumber):
    def step(self, action):
        return "well done"


class MalformedMessage(GuessNumber):
    def step(self, action):
        return StepResult([{"content": 42}])


class NonNumericReward(GuessNumber):
    def step(self, action):
        return StepResult([], reward="great", done=True)


class StepHangs(GuessNumber):
    def step(self, action):
        _hang()
        return super().step(action)


class SomeStepsHang(GuessNumber):
    """Hangs on rows whose secret is 0; answers the others at once."""

    def step(self, action):
        if self.secret == "0":
            _hang()
        return super().step(action)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def slow_lookup(key: str) -> str:
    """Look a key up (never answers).

    Args:
        key: what to look up
    """
    _hang()
    return key


class ToolCaller(GuessNumber):
    """Offers ``tool``; whatever the model writes, calls it with ``arguments`` (the test's fault),
    then ends the episode with reward 1 when the tool answered and 0 when it erred."""

    def __init__(self, tool: str = "add", arguments=None, tool_timeout_s: float = 120.0):
        self.tools = [Tool.from_function(globals()[tool])]
        self.box = ToolBox(self.tools, timeout_s=tool_timeout_s)
        self.arguments = arguments if arguments is not None else {"a": "2", "b": "3"}

    def step(self, action):
        from postrl.rollout.agentic.tools import ParsedCall

        text, record = self.box.call(ParsedCall(self.tools[0].name, self.arguments))
        return StepResult([], reward=0.0 if record.error else 1.0, done=True, tool_calls=[record])


def agent_raises(client, row):
    raise ValueError(f"no parser for {row['prompt']!r}")


def agent_never_calls(client, row):
    """An agent function that answers by itself: a reward, no model call."""
    return 1.0


def agent_calls_on_even_rows(client, row):
    """Calls the model on rows whose secret is even; returns a reward without a call on the others."""
    if row["secret"] % 2:
        return 0.0
    return agent_answers(client, row)


def agent_slow_answers(client, row):
    """Thinks for 50 ms by itself, then asks the model."""
    time.sleep(0.05)
    return agent_answers(client, row)


def agent_with_a_chatty_framework(client, row):
    """As an agent framework does: its own logger reports its retries and errors."""
    import logging

    chatty = logging.getLogger("chattyframework")
    for attempt in range(3):
        chatty.error("model call attempt %d failed: rate limited (row %s)", attempt, row["prompt"])
    return agent_answers(client, row)


def agent_answers(client, row):
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    return float(str(row["secret"]) in (reply.choices[0].message.content or ""))


def sigterm_twice(proc, started, wait_s: float = 60.0) -> tuple[float, str]:
    """Once ``started`` (a run's config.yaml) exists and its step has begun, SIGTERM ``proc`` twice:
    the seconds from the second signal to the exit (inf when it outlives ``wait_s``) and its stderr."""
    import signal
    import subprocess

    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)  # into the step: the episodes' environment steps hang
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    second = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return float("inf"), proc.communicate()[1]
    return time.monotonic() - second, err


class JitteryGuess(GuessNumber):
    """Two turns, each step answered after a random delay (the OS's randomness, not the run's seed):
    episodes' turns reach the engine in another order on every run."""

    def reset(self, row):
        self.turns = 0
        return super().reset(row)

    def step(self, action):
        time.sleep(random.SystemRandom().uniform(0.0, 0.03))
        self.turns += 1
        if self.turns < 2:
            return StepResult([{"role": "user", "content": "again"}], reward=0.0)
        return StepResult([], reward=float(self.secret in action), done=True)


def agent_thinks_a_while(client, row):
    """Thinks for 250 ms by itself, then asks the model (a batch of these is a long phase)."""
    time.sleep(0.25)
    return agent_answers(client, row)
