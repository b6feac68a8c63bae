"""The request bodies of the OpenAI-compatible server, validated by pydantic, and the checks and
text helpers they need. Parameters the server does not implement are refused by name."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field

from postrl.types import Rollout, SamplingParams

# OpenAI parameters this server does not implement, with the values that mean "not used";
# any other value is a 400 naming the parameter.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (None, 0),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


# Accepted and without effect on generation: request metadata.
METADATA = ("user", "metadata", "store", "service_tier")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(
        False,
        description="The prompt before the completion; with logprobs, the logprob of each prompt token after the "
        "first (untempered; the first token's is null), as a distillation teacher needs.",
    )


class TextPart(BaseModel):
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: str  # a JSON object, as the OpenAI API carries it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    refusal: str | None = None
    # an assistant turn's separate reasoning, as vLLM-style clients (verifiers') send it back: this
    # server returns none (the model's reasoning stays in content), so only an empty one is accepted
    reasoning_content: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    episode_id: str | None = Field(None, min_length=1, max_length=200)  # --record: the episode this call is part of
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class UpdateWeightsRequest(BaseModel):
    path: str
    version: int = Field(ge=0)
    manifest: dict[str, str] | None = None


def bad_request(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> HTTPException:
    return HTTPException(status, {"message": message, "param": param, "code": code})


def check_parameters(req: SamplingRequest) -> None:
    """A 400 for any parameter this server does not implement (or does not know), naming it."""
    for name, value in (req.model_extra or {}).items():
        if name in METADATA:
            continue
        if name in NOT_IMPLEMENTED:
            if value in NOT_IMPLEMENTED[name]:
                continue
            raise bad_request(
                f"parameter '{name}' is not supported by this server (got {value!r})",
                name,
                code="unsupported_parameter",
            )
        raise bad_request(f"unknown parameter '{name}'", name, code="unknown_parameter")


def message_text(message: ChatMessage, index: int) -> str:
    """A message's text: its string, or its text parts joined by newlines (other parts refused)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for i, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages.{index}.content.{i}: a part of type '{part.type}' is not supported (only text parts)",
                "messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def final_text(r: Rollout, params: SamplingParams, keep_stop: bool) -> str:
    """A response's text as the client gets it: cut at the first stop string unless kept."""
    return r.text if keep_stop else cut_at_stop(r.text, params.stop)[0]
