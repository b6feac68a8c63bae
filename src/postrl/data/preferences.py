"""Preference pairs for DPO from JSONL or Parquet: ``prompt``, ``chosen``, ``rejected`` strings, or
``chosen``/``rejected`` chat message lists that share every message but the last (the assistant's
answer). Bad rows get the same ``file:line`` errors as prompt datasets."""

from __future__ import annotations

from typing import Any

from postrl.data.dataset import DatasetError, _validate_messages, file_rows, parse_rows
from postrl.types.records import PreferencePair


def _completion_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return ids + ([eos] if eos is not None and (not ids or ids[-1] != eos) else [])


def pair_from_row(
    row: Any, tokenizer: Any, max_tokens: int, chat_template: bool = False
) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) token ids of one row; ValueError with the reason when malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"row must be an object, got {type(row).__name__}")
    missing = [c for c in ("chosen", "rejected") if c not in row]
    if missing:
        raise ValueError(f"row lacks {missing} (columns: {sorted(row)})")
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"'prompt' must be a non-empty string, got {prompt!r}")
        if chat_template:  # as a chat: the prompt is the user's message, rendered with the generation prompt
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            prompt_ids = tokenizer(prompt)["input_ids"]
        pair = (prompt_ids, _completion_ids(tokenizer, chosen), _completion_ids(tokenizer, rejected))
    elif isinstance(chosen, list) and isinstance(rejected, list):
        for name, messages in (("chosen", chosen), ("rejected", rejected)):
            problem = _validate_messages(messages)
            if problem:
                raise ValueError(problem.replace("'messages'", f"'{name}'"))
            if messages[-1]["role"] != "assistant":
                raise ValueError(f"the last message of '{name}' must be the assistant's answer")
        if chosen[:-1] != rejected[:-1]:
            raise ValueError("'chosen' and 'rejected' must share every message before the last")
        text = tokenizer.apply_chat_template(chosen[:-1], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pair = (
            prompt_ids,
            _completion_ids(tokenizer, chosen[-1]["content"]),
            _completion_ids(tokenizer, rejected[-1]["content"]),
        )
    else:
        raise ValueError("'chosen' and 'rejected' must both be strings (with 'prompt') or both message lists")
    longest = len(pair[0]) + max(len(pair[1]), len(pair[2]))
    if longest > max_tokens:
        raise ValueError(f"prompt + completion is {longest} tokens, more than data.max_tokens={max_tokens}")
    return pair


def load_preference_pairs(
    files: list[str], tokenizer: Any, max_tokens: int, on_bad_row: str = "error", chat_template: bool = False
) -> tuple[list[PreferencePair], list[str]]:
    def parse(source: str, row: Any) -> PreferencePair:
        return PreferencePair(*pair_from_row(row, tokenizer, max_tokens, chat_template), source)

    pairs, skipped = parse_rows(file_rows(files), parse, on_bad_row)
    if not pairs:
        raise DatasetError(f"no usable preference pairs in {files}")
    return pairs, skipped
