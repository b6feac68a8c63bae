"""``POST /v1/chat/completions`` and the turn machinery the other chat APIs share.

A call is rendered through the chat template (with its tools), its answer parsed into content and
tool calls, streamed or not; with ``--record``, a call that names an episode (``episode_id``, the
``X-Episode-Id`` header, or a base URL ``/episodes/{id}/v1``) is generated from the episode's exact
tokens and recorded (:mod:`postrl.rollout.agentic.recorder`). The Responses and Messages endpoints
translate their requests into a :class:`ChatRequest` and their answers from :class:`Answer`s, so
every API records the same way."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from postrl.rollout.agentic.recorder import EpisodeRecorder, EpisodesSuspended, PendingTurn
from postrl.serve.chat_turn import ChatTurn, template_message
from postrl.serve.openai_protocol import ChatRequest, bad_request
from postrl.serve.sse import ChunkEncoder, SSEStream, StreamEncoder, choice_factory, first_stop
from postrl.serve.turn_context import TurnContext, add_api_routes
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.types.episode import ModelCall


@dataclass(frozen=True)
class Answer:
    """One generated choice as every API returns it."""

    rollout: Rollout
    message: dict[str, Any]  # the assistant message, in the chat API's form
    stop_string: str | None  # the stop string it ended on


@dataclass
class PreparedTurn:
    """A call ready to generate: its prompt, sampling, and where its answer is recorded."""

    ctx: TurnContext
    turn: ChatTurn
    prompt: Prompt
    params: SamplingParams
    user_stops: tuple[str, ...]
    keep_stop: bool
    pending: PendingTurn | None

    @staticmethod
    def of(ctx: TurnContext, req: ChatRequest, episode: str | None) -> PreparedTurn:
        ctx.check_request(req, 1)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        turn = ChatTurn.of(req, ctx.tooling)
        prompt, pending = _prompt(ctx, turn, episode)
        try:
            params = _sampling(ctx, req, prompt, turn, pending is not None)
        except Exception:
            if pending is not None and ctx.recorder is not None:
                ctx.recorder.release(pending)
            raise
        user_stops = tuple(s for s in params.stop if s not in turn.extra_stops)
        return PreparedTurn(ctx, turn, prompt, params, user_stops, req.include_stop_str_in_output, pending)

    def answers(self, rollouts: list[Rollout]) -> list[Answer]:
        out = []
        for r in rollouts:
            raw, plain = self.ctx.turn_text(r, special=True), self.ctx.turn_text(r, special=False)
            message = self.turn.reply(raw, plain, self.user_stops, self.keep_stop)
            out.append(Answer(r, message, first_stop(raw, self.user_stops)))
        return out

    def record(self, done: asyncio.Future[list[Rollout]], answers: list[Answer] | None = None) -> None:
        """The generation's end: its answers (parsed here when not given) recorded into the episode;
        a failed or cancelled one frees its sample."""
        recorder: EpisodeRecorder | None = self.ctx.recorder
        if self.pending is None or recorder is None:
            return
        if done.cancelled() or done.exception() is not None:
            recorder.release(self.pending)
            return
        rollouts = done.result()
        answers = self.answers(rollouts) if answers is None else answers
        recorder.record(self.pending, rollouts, [template_message(a.message) for a in answers])

    async def generate(self) -> list[Answer]:
        """The answers, recorded before they are returned (the agent's next call continues them):
        parsed once, so the recorded messages are the returned ones, tool call ids included. An
        episode's call that a checkpoint cut is refused (503: the episode runs again after it); one
        cut by a suspend meant for an earlier call is generated again."""
        while True:
            task = asyncio.ensure_future(self._rollouts())
            try:
                rollouts = await task
            except BaseException:  # the generation failed, or this call was cancelled: free the sample when it ends
                task.add_done_callback(self.record)
                raise
            recorder = self.ctx.recorder
            if self.pending is None or recorder is None or all(r.finish_reason != "suspended" for r in rollouts):
                break
            if recorder.suspended:
                recorder.release(self.pending)
                raise bad_request("a checkpoint suspended this episode; the run runs it again", "episode_id", 503)
        answers = self.answers(rollouts)
        self.record(task, answers)
        return answers

    async def _rollouts(self) -> list[Rollout]:
        replayed = None if self.pending is None else self.pending.replayed
        if replayed is None:
            return await self.ctx.batcher.generate([self.prompt], self.params)
        return _recorded(replayed)  # a re-run episode's call made before a checkpoint: its recorded answer

    def stream(self, encoder: StreamEncoder) -> StreamingResponse:
        new_choice = choice_factory(self.ctx, self.user_stops, self.keep_stop, self.turn, chat=True)
        return SSEStream(self.ctx, [self.prompt], self.params, encoder, new_choice, self.record).response()


def _prompt(ctx: TurnContext, turn: ChatTurn, episode: str | None) -> tuple[Prompt, PendingTurn | None]:
    if episode is None:
        renderer = ctx.chat_renderer()
        text = renderer.render(turn.messages, generation_prompt=True, tools=turn.tools) + turn.prefix
        return Prompt(text=text, prompt_ids=renderer.encode(text)), None
    if ctx.recorder is None:
        raise bad_request("this server does not record episodes (start it with --record)", "episode_id")
    try:
        pending = ctx.recorder.prompt(episode, turn.messages, turn.tools, turn.prefix, sent=turn.sent)
    except EpisodesSuspended as exc:
        raise bad_request(str(exc), "episode_id", 503) from None
    except ValueError as exc:
        raise bad_request(str(exc), "episode_id", 429) from None
    return Prompt(text="", prompt_ids=pending.context, cache_key=pending.cache_key), pending


def _recorded(call: ModelCall) -> list[Rollout]:
    return [
        Rollout(0, list(call.prompt_ids), ids, lp, "", reason, call.weight_version, logprob_versions=v, kv_versions=kv)  # type: ignore[arg-type]
        for ids, lp, v, kv, reason in zip(
            call.response_ids, call.logprobs, call.versions, call.kv_versions, call.finish_reasons, strict=True
        )
    ]


def _sampling(ctx: TurnContext, req: ChatRequest, prompt: Prompt, turn: ChatTurn, recorded: bool) -> SamplingParams:
    k = (req.top_logprobs or 0) if req.logprobs else 0
    field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    params = ctx.sampling(req, [prompt], req.max_completion_tokens or req.max_tokens, k, field)
    params = replace(params, stop=(*params.stop, *turn.extra_stops))
    if recorded:  # the model's turn ends where the template's does
        ends = ctx.chat_renderer().end_of_turn_ids()
        params = replace(params, stop_token_ids=tuple(sorted({*params.stop_token_ids, *ends})))
    return params


async def chat_completion(
    ctx: TurnContext, req: ChatRequest, episode: str | None
) -> dict[str, Any] | StreamingResponse:
    prepared = PreparedTurn.of(ctx, req, episode)
    k = (req.top_logprobs or 0) if req.logprobs else None
    if req.stream:
        return prepared.stream(ChunkEncoder(ctx, req, [prepared.prompt], chat=True, k=k))
    answers = await prepared.generate()
    choices = []
    for sample, a in enumerate(answers):
        r = a.rollout
        lp = ctx.chat_logprobs(r.response_ids, r.logprobs, r.top_logprobs, k) if k is not None else None
        reason = "tool_calls" if a.message.get("tool_calls") else r.finish_reason
        choices.append(
            {
                "index": sample,
                "message": a.message,
                "finish_reason": reason,
                "token_ids": r.response_ids,
                "logprobs": lp,
            }
        )
    return ctx.envelope("chatcmpl", "chat.completion", choices, [prepared.prompt], [a.rollout for a in answers])


def add_chat_routes(app: FastAPI, ctx: TurnContext) -> None:
    """``/v1/chat/completions`` (and, recording, under an episode's base URL)."""
    add_api_routes(app, ctx, "/chat/completions", ChatRequest, chat_completion)
