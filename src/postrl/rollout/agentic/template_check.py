"""Is a chat template append-only? Probe conversations, grown turn by turn as an episode grows.

For every probe step the check does what the episode runner does: render the conversation with
the generation prompt, append the model's turn as the engine would have produced it (its
content, then the template's end-of-turn token), add the next messages, render again, and ask
whether the text already seen is a prefix of the new rendering. It also reports whether
re-tokenizing the whole conversation would keep the earlier tokens (what frameworks that
re-tokenize silently rely on), with the first token that differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from postrl.config.run import ConfigError
from postrl.rollout.agentic.chat import ChatRenderer, first_difference

Messages = list[dict[str, Any]]
_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>'
_TWO_CALLS = _CALL + "\n" + _CALL.replace("123 * 456", "7 + 8")
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _tool(text: str) -> dict[str, Any]:
    return {"role": "tool", "name": "calculator", "content": text}


# name -> (first messages, [(the model's turn, the messages that come back), ...])
PROBES: dict[str, tuple[Messages, list[tuple[str, Messages]]]] = {
    "multi_turn": ([_user("What is 2+2?")], [("4", [_user("And 3+3?")]), ("6", [_user("And 4+4?")])]),
    "system_prompt": (
        [{"role": "system", "content": "Answer briefly."}, _user("Hi")],
        [("Hello!", [_user("What is 2+2?")])],
    ),
    "tool_call": (
        [_user("What is 123*456?")],
        [(_CALL, [_tool("56088")]), ("<answer>56088</answer>", [_user("Thanks")])],
    ),
    "two_tool_results": ([_user("Compute both.")], [(_TWO_CALLS, [_tool("56088"), _tool("15")])]),
    "reasoning": (
        [_user("What is 2+2?")],
        [("<think>\nadd them\n</think>\n\n4", [_user("And 3+3?")])],
    ),
    "reasoning_then_tool": (
        [_user("What is 123*456?")],
        [("<think>\nuse the tool\n</think>\n\n" + _CALL, [_tool("56088")])],
    ),
    "whitespace": ([_user("Say hi")], [(" hi \n", [_user("Again")])]),
}


@dataclass(frozen=True)
class CaseReport:
    name: str
    append_only: bool
    retokenization_safe: bool  # re-encoding the whole conversation keeps the earlier tokens
    turn: int | None = None  # the first step (from 1) where either fails
    detail: str = ""  # where the text or the tokens first differ

    def line(self) -> str:
        verdict = "append-only" if self.append_only else "NOT append-only"
        tokens = "re-tokenizes the same" if self.retokenization_safe else "re-tokenizing changes tokens"
        where = f" (turn {self.turn}: {self.detail})" if self.detail else ""
        return f"{self.name:20s} {verdict:16s} {tokens}{where}"


@dataclass(frozen=True)
class TemplateReport:
    cases: list[CaseReport]
    tools_rendered: bool = True  # the tool definitions (tools=) reach the rendered prompt

    @property
    def append_only(self) -> bool:
        return all(c.append_only for c in self.cases)

    def broken(self) -> list[str]:
        return [c.name for c in self.cases if not c.append_only]

    def summary(self, policy: str | None = None, tools_shown: bool = True) -> str:
        """``tools_shown``: the tools reach the model through the template's ``tools=`` (a run whose
        tools go into a system message, or that offers none, is not told that the template drops them)."""
        if self.append_only:
            text = "the chat template is append-only in every probe: each turn's context extends the last exactly"
        else:
            text = f"the chat template rewrites earlier turns in: {', '.join(self.broken())}"
            if policy is not None:
                text += f"; agent.on_prefix_break={policy} applies there"
        return text if self.tools_rendered or not tools_shown else f"{text}; {TOOLS_DROPPED}"

    def tools_line(self) -> str:
        return (
            "tools               rendered into the prompt"
            if self.tools_rendered
            else f"tools               {TOOLS_DROPPED}"
        )


def refuse_dropped_tools(
    report: TemplateReport, tools: list[dict[str, Any]], tools_in_prompt: str, model: str, source: str
) -> None:
    """A ConfigError where ``source``'s tools would reach the model through the template's tools=
    (``agent.tools_in_prompt: template``) and the template of ``model`` drops them."""
    if tools and not report.tools_rendered and tools_in_prompt == "template":
        names = ", ".join(t["function"]["name"] for t in tools)
        raise ConfigError(
            f"agent.tools_in_prompt=template: the chat template of {model} ignores tools=, so the model "
            f"would never see the tools of {source} ({names}); set agent.tools_in_prompt: "
            "system (postrl writes them into a system message), none (the model was trained on them) or use a "
            "model whose template renders tools"
        )


TOOLS_DROPPED = (
    "the template DROPS the tool definitions (tools=): the model never sees them; set agent.tools_in_prompt: "
    "system (postrl writes them into a system message), none (the model knows them) or use a template that "
    "renders tools"
)


def tools_reach_prompt(renderer: ChatRenderer) -> bool:
    """Whether the template puts the renderer's tools into the prompt: the rendering changes with
    them and names each tool."""
    if not renderer.tools:
        return True
    messages = [_user("Say hi")]
    bare = ChatRenderer(renderer.tokenizer).render(messages, generation_prompt=True)
    full = renderer.render(messages, generation_prompt=True)
    names = [t.get("function", {}).get("name", "") for t in renderer.tools]
    return full != bare and all(name in full for name in names)


def check_template(tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> TemplateReport:
    renderer = ChatRenderer(tokenizer, tools or [CALCULATOR_SCHEMA])
    end = "".join(renderer.decode(renderer.end_of_turn_ids()))
    cases = [_check_case(renderer, name, *PROBES[name], end) for name in PROBES]
    return TemplateReport(cases, tools_reach_prompt(renderer))


def _check_case(
    renderer: ChatRenderer, name: str, first: Messages, steps: list[tuple[str, Messages]], end: str
) -> CaseReport:
    messages = list(first)
    seen = renderer.render(messages, generation_prompt=True)
    append_only = safe = True
    failed_turn, detail = None, ""
    for turn, (model_turn, back) in enumerate(steps, start=1):
        seen += model_turn + end
        messages = [*messages, {"role": "assistant", "content": model_turn}, *back]
        full = renderer.render(messages, generation_prompt=True)
        if append_only and not full.startswith(seen):
            append_only, at = False, first_difference(seen, full)
            failed_turn = failed_turn or turn
            detail = f"seen {json.dumps(seen[at : at + 24])} but re-rendered {json.dumps(full[at : at + 24])}"
        before, after = renderer.encode(seen), renderer.encode(full)
        if safe and after[: len(before)] != before:
            safe = False
            k = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            if failed_turn is None:
                failed_turn = turn
                detail = f"token {k}: {_token(renderer, before, k)} becomes {_token(renderer, after, k)}"
        seen = full
    return CaseReport(name, append_only, safe, failed_turn, detail)


def _token(renderer: ChatRenderer, ids: list[int], k: int) -> str:
    return json.dumps(renderer.decode([ids[k]])) if k < len(ids) else "(end)"
