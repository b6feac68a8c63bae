"""Agent functions of runs with two policies (tests/test_policies.py): a proposer writes a sum, a
solver answers it; each call names its policy by ``model`` (or goes to the policy's own base URL)."""

from __future__ import annotations

import os
import threading
import time

import openai

CALLS: list[tuple[str, str, str]] = []  # (policy, the prompt's last message, the completion), every call
_lock = threading.Lock()


def _ask(client: openai.OpenAI, model: str, content: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=1.0, max_tokens=6
    )
    text = reply.choices[0].message.content or ""
    with _lock:
        CALLS.append((model, content, text))
    return text


def propose_and_solve(client: openai.OpenAI, row: dict) -> dict[str, float]:
    """The proposer continues the row's prompt, the solver answers the proposer's text: each is
    rewarded for digits in its own answer (the proposer's count, the solver's with a bonus)."""
    time.sleep(float(os.environ.get("POLICY_AGENT_DELAY_S", "0")))  # a run slow enough to be killed mid-step
    proposal = _ask(client, "proposer", row["prompt"])
    answer = _ask(client, "solver", proposal or row["prompt"])
    return {
        "proposer": sum(c.isdigit() for c in proposal) / 6,
        "solver": sum(c.isdigit() for c in answer) / 6,
    }


def by_base_url(client: openai.OpenAI, row: dict) -> float:
    """The same, each policy reached at its own base URL (as a framework given one base URL per
    agent would be); one reward for both."""
    urls = row["policy_urls"]
    proposer = openai.OpenAI(base_url=urls["proposer"], api_key="x", max_retries=0)
    solver = openai.OpenAI(base_url=urls["solver"], api_key="x", max_retries=0)
    try:
        proposal = _ask(proposer, "proposer", row["prompt"])
        answer = _ask(solver, "solver", proposal or row["prompt"])
    finally:
        proposer.close()
        solver.close()
    return sum(c.isdigit() for c in answer) / 6


def solver_only(client: openai.OpenAI, row: dict) -> dict[str, float]:
    """Only the solver acts; the rewards name the proposer too (it has no samples: nothing to score)."""
    answer = _ask(client, "solver", row["prompt"])
    return {"solver": sum(c.isdigit() for c in answer) / 6, "proposer": 0.0}


def leaves_out_the_solver(client: openai.OpenAI, row: dict) -> dict[str, float]:
    proposal = _ask(client, "proposer", row["prompt"])
    _ask(client, "solver", proposal or row["prompt"])
    return {"proposer": 1.0}
