"""A chat template as a renderer of deltas: the tokens that new messages add to a context.

The engine's tokens are the source of truth. A turn's prompt is the previous context's exact
tokens plus the tokens of the new messages' *delta*: the text the template adds when the
conversation grows, found by rendering the whole conversation and checking that the text the
engine has already seen is a prefix of it. Where it is not (the template rewrote the history:
Qwen3 drops earlier ``<think>`` blocks, Llama 3 trims whitespace), :meth:`ChatRenderer.delta`
says where the two first differ instead of re-tokenizing anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

PROBE_CONTENT = "PROBE_CONTENT_7"  # a text no template changes, to find what a template puts around content


@dataclass(frozen=True)
class Delta:
    """What new messages add. ``text`` and ``ids``: the delta (None at a prefix break); ``break_at``:
    the first character of the already-seen text that the new rendering changes."""

    text: str | None
    ids: list[int] | None
    break_at: int | None = None

    @property
    def ok(self) -> bool:
        return self.text is not None


def first_difference(a: str, b: str) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatRenderer:
    """A tokenizer's chat template, with the tools it offers (``tools=`` of the template)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> None:
        if not tokenizer.chat_template:
            raise ValueError("multi-turn episodes need a tokenizer with a chat template (tokenizer.chat_template)")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = template_kwargs

    def render(
        self, messages: list[dict[str, Any]], generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The conversation as the template writes it (``tools``: these instead of the renderer's)."""
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or self.tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Template text to ids: its special-token text (``<|im_start|>``) becomes those tokens, and
        nothing is added (the template wrote the BOS where it wants one)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Generated ids as the template sees them: special tokens kept as their text."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def delta(self, seen: str, messages: list[dict[str, Any]], generation_prompt: bool = True) -> tuple[Delta, str]:
        """The delta from ``seen`` (the text of the context so far: what was rendered plus what the
        model generated) to ``messages`` rendered whole; returns it and that whole rendering."""
        full = self.render(messages, generation_prompt)
        if full.startswith(seen):
            text = full[len(seen) :]
            return Delta(text, self.encode(text) if text else []), full
        return Delta(None, None, first_difference(seen, full)), full

    def appended_delta(self, new: list[dict[str, Any]]) -> Delta:
        """The delta of ``new`` messages as the template renders them after a plain exchange
        (``on_prefix_break: keep_context``): the model's own history is kept as it was, and the new
        messages are appended in the template's format, with the generation prompt."""
        plain = [{"role": "user", "content": PROBE_CONTENT}, {"role": "assistant", "content": PROBE_CONTENT}]
        before = self.render(plain, generation_prompt=False)
        after = self.render(plain + new, generation_prompt=True)
        if not after.startswith(before):
            return Delta(None, None, first_difference(before, after))
        text = after[len(before) :]
        return Delta(text, self.encode(text))

    def model_turn(self, ids: list[int], stopped: bool) -> tuple[str, str]:
        """A model turn's message content and the template text its tokens stand for. A turn that
        ended on a special token (the template's end-of-turn, or the model's EOS) ended where the
        template ends an assistant message: the content is what came before it, and the token
        stands for the template's end-of-turn text, so the next delta starts after it."""
        if stopped and ids and ids[-1] in self.special_ids:
            content = self.decode(ids[:-1])
            end = self.end_of_turn_ids()
            return content, content + self.decode(end if end else ids[-1:])
        content = self.decode(ids)
        return content, content

    @property
    def special_ids(self) -> set[int]:
        return set(self.tokenizer.all_special_ids) | set(self.end_of_turn_ids())

    def end_of_turn(self) -> str:
        """The text the template puts right after an assistant message's content (``<|im_end|>\\n``
        for ChatML): where the model's turn ends."""
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE_CONTENT}]
        text = self.render(messages, generation_prompt=False)
        at = text.rfind(PROBE_CONTENT)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content as given")
        return text[at + len(PROBE_CONTENT) :]

    def end_of_turn_ids(self) -> list[int]:
        """The token that ends a model's turn, when the template's end-of-turn text starts with a
        single special (added) token (``<|im_end|>``, ``<|eot_id|>``); else none."""
        tail = self.end_of_turn()
        for token in self.tokenizer.all_special_tokens + list(self.tokenizer.get_added_vocab()):
            if token and tail.startswith(token):
                return [self.tokenizer.convert_tokens_to_ids(token)]
        return []


def with_tools_system_message(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tools described in their system message (one is added first when there
    is none): for chat templates that ignore ``tools=`` (``agent.tools_in_prompt: system``)."""
    lines = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    text = (
        'You may call these tools. To call one, write <tool_call>{"name": ..., "arguments": {...}}</tool_call>; '
        f"its answer comes back in a tool message.\n<tools>\n{lines}\n</tools>"
    )
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
