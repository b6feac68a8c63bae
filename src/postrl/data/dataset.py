"""Prompt datasets from JSONL and Parquet files (or a built-in task).

A row has a ``prompt`` string or a ``messages`` chat list; every other column is kept and reaches
the reward function untouched. A malformed row or a too-long prompt is an error naming the file
and line, or, with ``on_bad_row: skip``, skipped and counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from postrl.types import Prompt

DEFAULT_MAX_PROMPT_TOKENS = 512  # the prompt bound for models that do not declare a context length


class DatasetError(ValueError):
    """A dataset row or file that cannot be used; the message names the file and line."""


@dataclass
class PromptDataset:
    prompts: list[Prompt]
    skipped: list[str] = field(default_factory=list)  # one "file:line: reason" per skipped row

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]


@dataclass(frozen=True)
class MalformedRow:
    """A row that could not even be parsed; handled like any other bad row."""

    reason: str


def iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(source, row) pairs, source being "file:line"; unparsable lines come as MalformedRow."""
    if not path.is_file():
        where = (
            ""
            if path.is_absolute()
            else (
                f" (a relative path is looked up in the working directory {os.getcwd()}, then next to the config file)"
            )
        )
        raise DatasetError(f"dataset file {path} does not exist{where}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte-order mark, as some editors write
                yield f"{path}:{lineno}", _parse_json_line(raw)
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DatasetError(f"dataset file {path} is not a readable Parquet file: {reason}") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield f"{path}:row {i}", row
    else:
        raise DatasetError(f"dataset file {path}: unsupported extension '{suffix}' (use .jsonl or .parquet)")


def _parse_json_line(raw: bytes) -> Any:
    """One JSONL line as a value, or a MalformedRow whose reason gives the 1-based column of the fault
    (in characters of the line) and the text around it."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        col = len(raw[: exc.start].decode("utf-8", errors="replace")) + 1
        return MalformedRow(f"not valid UTF-8 at column {col} (byte 0x{raw[exc.start]:02x})")
    if not line.strip():
        return _BLANK
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        text = line.rstrip("\r\n")
        # colno counts from the start of the string given to json, which is the whole line
        col = exc.pos - text.rfind("\n", 0, exc.pos) if "\n" in text[: exc.pos] else exc.pos + 1
        near = text[max(0, exc.pos - 20) : exc.pos + 20]
        return MalformedRow(f"invalid JSON at column {col}: {exc.msg} (near {near!r})")


_BLANK = object()  # an empty line: not a row at all


def _validate_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {role, content} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"'messages'[{i}] must be an object with string 'role' and 'content'"
    return None


def prompt_text(row: Any, tokenizer: Any, prompt_column: str, messages_column: str, chat: bool) -> tuple[str, bool]:
    """The prompt text of one row and whether the tokenizer adds its special tokens to it (a
    rendered chat template holds them already); raises ValueError with the reason when malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"row must be an object, got {type(row).__name__}")
    if prompt_column in row and row[prompt_column] is not None:
        text = row[prompt_column]
        if not isinstance(text, str) or not text:
            raise ValueError(f"'{prompt_column}' must be a non-empty string, got {text!r}")
        if not chat:
            return text, True
        messages = [{"role": "user", "content": text}]
    elif messages_column in row:
        messages = row[messages_column]
        problem = _validate_messages(messages)
        if problem:
            raise ValueError(problem)
    else:
        raise ValueError(f"row has neither '{prompt_column}' nor '{messages_column}' (columns: {sorted(row)})")
    if not tokenizer.chat_template:
        raise ValueError(
            "the model's tokenizer has no chat template (a base model's, e.g. Gemma 3 270M's GGUF), so chat "
            "rows cannot be rendered: give plain prompts (data.apply_chat_template: false, "
            "data.reasoning_gym.chat_template: false) or use a model whose tokenizer has one"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False


def tokenize_texts(tokenizer: Any, texts: list[tuple[str, bool]], chunk: int = 4096) -> list[list[int]]:
    """The ids of ``(text, add_special_tokens)`` pairs, tokenized in batches (a fast tokenizer
    encodes a batch in parallel, ~10x the rate of one call per row)."""
    ids: list[list[int]] = [[] for _ in texts]
    for special in (True, False):
        rows = [i for i, (_, s) in enumerate(texts) if s is special]
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            encoded = tokenizer([texts[i][0] for i in part], add_special_tokens=special)["input_ids"]
            for i, row_ids in zip(part, encoded, strict=True):
                ids[i] = list(row_ids)
    return ids


T = TypeVar("T")


def file_rows(files: list[str]) -> Iterator[tuple[str, Any]]:
    """``(source, row)`` of every row of the files, in order."""
    for file in files:
        yield from iter_rows(Path(file))


def parse_rows(
    rows: Iterable[tuple[str, Any]], parse: Callable[[str, Any], T], on_bad_row: str = "error"
) -> tuple[list[T], list[str]]:
    """``parse(source, row)`` over the rows (blank lines skipped); a row it refuses with a
    ValueError is a :class:`DatasetError` naming ``file:line``, or with ``on_bad_row="skip"``, one
    ``"file:line: reason"`` in the second list."""
    items: list[T] = []
    skipped: list[str] = []
    for source, row in rows:
        if row is _BLANK:
            continue
        try:
            if isinstance(row, MalformedRow):
                raise ValueError(row.reason)
            items.append(parse(source, row))
        except ValueError as exc:
            if on_bad_row != "skip":
                raise DatasetError(f"{source}: {exc}") from None
            skipped.append(f"{source}: {exc}")
    return items, skipped


# a parsed row: (place among the rows read, source, other columns, (text, add special tokens), messages)
_Parsed = tuple[int, str, dict[str, Any], tuple[str, bool], "list[dict[str, Any]] | None"]


def build_prompts(
    rows: Iterator[tuple[str, Any]],
    tokenizer: Any,
    *,
    prompt_column: str = "prompt",
    messages_column: str = "messages",
    apply_chat_template: bool = False,
    max_prompt_tokens: int = 512,
    on_bad_row: str = "error",
) -> PromptDataset:
    rows_read: list[str] = []  # every non-blank row's source, in order: where each skipped row was

    def numbered() -> Iterator[tuple[str, Any]]:
        for source, row in rows:
            if row is not _BLANK:
                rows_read.append(source)
            yield source, row

    def parse(source: str, row: Any) -> _Parsed:
        text = prompt_text(row, tokenizer, prompt_column, messages_column, apply_chat_template)
        columns = {k: v for k, v in row.items() if k not in (prompt_column, messages_column)}
        messages = row[messages_column] if row.get(prompt_column) is None else None  # a chat row's, for episodes
        return len(rows_read) - 1, source, columns, text, messages

    parsed, refused = parse_rows(numbered(), parse, on_bad_row)
    ids = tokenize_texts(tokenizer, [text for *_, text, _ in parsed])
    too_long = [
        (at, f"{source}: prompt has {len(row_ids)} tokens, more than data.max_prompt_tokens={max_prompt_tokens}")
        for (at, source, *_), row_ids in zip(parsed, ids, strict=True)
        if len(row_ids) > max_prompt_tokens
    ]
    if too_long and on_bad_row != "skip":
        raise DatasetError(too_long[0][1])
    kept = {at for at, *_ in parsed}
    refused_at = [at for at in range(len(rows_read)) if at not in kept]  # parse_rows keeps the rows' order
    skipped = [reason for _, reason in sorted([*zip(refused_at, refused, strict=True), *too_long])]
    prompts = [
        Prompt(text=text, prompt_ids=row_ids, columns=columns, source=source, messages=messages)
        for (_, source, columns, (text, _), messages), row_ids in zip(parsed, ids, strict=True)
        if len(row_ids) <= max_prompt_tokens
    ]
    return PromptDataset(prompts=prompts, skipped=skipped)


def load_prompt_dataset(files: list[str], tokenizer: Any, **options: Any) -> PromptDataset:
    dataset = build_prompts(file_rows(files), tokenizer, **options)
    if not dataset.prompts:
        raise DatasetError(f"no usable prompts in {', '.join(files)} ({len(dataset.skipped)} rows skipped)")
    return dataset
