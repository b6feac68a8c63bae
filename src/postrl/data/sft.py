"""Supervised fine-tuning examples from JSONL or Parquet: ``prompt``/``response`` strings, or a
``messages`` chat list whose assistant turns are the targets.

An example is a token sequence with a mask of the tokens that carry loss: the response (with
EOS), or every assistant turn of a conversation rendered by the tokenizer's chat template (the
role headers and the user, system and tool turns are context only). Each turn's tokens are the
template's rendering of the conversation up to it minus the rendering before it; a template that
does not render a conversation as an extension of its own prefix is refused, naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from postrl.data.dataset import DatasetError, _validate_messages, file_rows, parse_rows
from postrl.data.preferences import _completion_ids


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]  # context before the first trained token
    response_ids: list[int]  # everything after it
    loss_mask: list[int]  # per response token: 1 = trained
    source: str


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def conversation_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The conversation's token ids and a 0/1 mask that is 1 on the assistant turns' tokens."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before = _chat_ids(tokenizer, messages[:i], generation_prompt=True)
            if before[: len(ids)] != ids:
                raise ValueError(
                    f"the chat template renders message {i}'s generation prompt without the "
                    "conversation before it as a prefix, so the trained tokens cannot be located"
                )
            mask += [0] * (len(before) - len(ids))
            ids = before
        full = _chat_ids(tokenizer, messages[: i + 1], generation_prompt=False)
        if full[: len(ids)] != ids:
            raise ValueError(
                f"the chat template rewrites the conversation before message {i} when it is added "
                "(e.g. it drops earlier reasoning), so its tokens cannot be trained turn by turn"
            )
        mask += [int(message["role"] == "assistant")] * (len(full) - len(ids))
        ids = full
    return ids, mask


def example_from_row(
    row: Any,
    tokenizer: Any,
    prompt_column: str,
    response_column: str,
    messages_column: str,
    chat: bool,
    max_tokens: int,
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one row; ValueError with the reason when malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"row must be an object, got {type(row).__name__}")
    if messages_column in row and row[messages_column] is not None:
        messages = row[messages_column]
        problem = _validate_messages(messages)
        if problem:
            raise ValueError(problem.replace("'messages'", f"'{messages_column}'"))
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"'{messages_column}' has no assistant turn to train on")
        ids, mask = conversation_tokens(tokenizer, messages)
    elif prompt_column in row and response_column in row:
        prompt, response = row[prompt_column], row[response_column]
        for name, value in ((prompt_column, prompt), (response_column, response)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"'{name}' must be a non-empty string, got {value!r}")
        if chat:
            prompt_ids = _chat_ids(tokenizer, [{"role": "user", "content": prompt}], generation_prompt=True)
        else:
            prompt_ids = tokenizer(prompt)["input_ids"]
        target = _completion_ids(tokenizer, response)
        ids, mask = prompt_ids + target, [0] * len(prompt_ids) + [1] * len(target)
    else:
        raise ValueError(
            f"row needs '{prompt_column}' and '{response_column}', or '{messages_column}' (columns: {sorted(row)})"
        )
    if len(ids) > max_tokens:
        raise ValueError(f"the example is {len(ids)} tokens, more than data.max_tokens={max_tokens}")
    return ids, mask


def load_sft_examples(
    files: list[str],
    tokenizer: Any,
    prompt_column: str = "prompt",
    response_column: str = "response",
    messages_column: str = "messages",
    chat: bool = False,
    max_tokens: int = 512,
    on_bad_row: str = "error",
) -> tuple[list[SFTExample], list[str]]:
    def parse(source: str, row: Any) -> SFTExample:
        ids, mask = example_from_row(row, tokenizer, prompt_column, response_column, messages_column, chat, max_tokens)
        first = mask.index(1)
        return SFTExample(ids[:first], ids[first:], mask[first:], source)

    examples, skipped = parse_rows(file_rows(files), parse, on_bad_row)
    if not examples:
        raise DatasetError(f"no usable examples in {files}")
    return examples, skipped
