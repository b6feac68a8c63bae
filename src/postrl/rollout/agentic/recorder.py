"""Token-exact trajectories of agents that speak the OpenAI API (``postrl serve-rollout --record``).

An agent sends the whole conversation with every chat request; the server must not re-tokenize
what the model already generated. For a request of a recorded episode the recorder renders the
conversation and looks for a sample of the episode whose text (what its context's exact tokens
stand for) is a prefix of it; the prompt is then that sample's exact tokens plus the delta's.
After the model's turn, the sample's text becomes the template's own rendering of the assistant
message the server returned (its tool calls in the template's format, its content as the template
writes it), cut where the generated tokens end: an agent that sends the message back as it got
it continues the exact tokens, even where the template formats a call differently from the model.

One episode may hold several samples, by these rules (every generated token is trained once):
- a request extends the idle sample with the longest text that its rendering starts with;
- a request whose rendering starts with a sample's text while that sample is generating (an
  agent calling the API concurrently on one conversation), and every choice after the first of a
  call with ``n > 1``, forks: a new sample whose prompt is the shared context (its earlier model
  tokens are not trained again in it);
- a request whose text continues no sample but whose messages continue one message by message,
  up to the edits frameworks make (:mod:`~postrl.rollout.agentic.history_match`: whitespace,
  dropped ``tools``, re-serialised arguments, removed reasoning), extends that sample: its new
  messages are rendered after the recorded ones, with the recorded tools, so the earlier turns keep
  the engine's tokens (counted in ``history_edits`` by kind);
- where even that rendering does not continue the sample because the chat template itself drops
  earlier reasoning (thinking templates), the model sees the template's rendering: a new sample
  starts from it (counted as ``history_edits["reasoning_split"]``, not as a break), so each turn is
  trained with the context the model saw;
- a request that continues no sample (the agent rewrote the history, or a sub-agent started its
  own conversation) starts a new sample from the template's rendering (counted in
  ``prefix_breaks`` when the episode already had samples)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.history_match import continues, edits, without_reasoning
from postrl.rollout.agentic.trajectory import sample_rollout
from postrl.types import Rollout
from postrl.types.episode import Episode, ModelCall, RecordedCalls, ToolCallRecord, TrajectorySample, Turn

log = logging.getLogger(__name__)


class EpisodesSuspended(Exception):
    """A checkpoint suspended the recorded episodes: no model call is taken until they resume."""


@dataclass
class SampleHistory:
    """What a sample's context stands for: the template text, the messages the agent sent and got
    back (before the server added a tools message), the messages rendered, and the tools."""

    seen: str
    sent: list[dict[str, Any]] = field(default_factory=list)
    rendered: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


@dataclass
class RecordedEpisode:
    samples: list[TrajectorySample] = field(default_factory=list)
    seen: list[SampleHistory] = field(default_factory=list)  # per sample
    busy: set[int] = field(default_factory=set)  # samples with a turn being generated
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    prefix_breaks: int = 0
    history_edits: dict[str, int] = field(default_factory=dict)
    calls: list[ModelCall] = field(default_factory=list)  # every completed engine call, in order
    replay: list[ModelCall] = field(default_factory=list)  # recorded calls still to answer (a re-run)
    replayed: int = 0
    rerun: bool = False  # run again after a checkpoint suspended it
    forks: int = 0
    finish_reason: str = "stop"
    generate_s: float = 0.0  # its model calls' time, from request to answer, summed

    def rollouts(
        self, prompt_index: int, renderer: ChatRenderer, reward: float | None, wall_s: float = 0.0
    ) -> list[Rollout]:
        kept = [s for s in self.samples if any(s.mask)]
        episode = self.episode(reward, wall_s=wall_s)
        return [sample_rollout(prompt_index, s, episode, part, renderer) for part, s in enumerate(kept)]

    def episode(self, reward: float | None, info: dict[str, Any] | None = None, wall_s: float = 0.0) -> Episode:
        """The episode; ``wall_s``: its agent function's whole time, of which what its model calls
        did not take is its ``env_s``."""
        kept = sum(any(s.mask) for s in self.samples)
        dropped = {"no_model_tokens": len(self.samples) - kept} if len(self.samples) > kept else {}
        rerun = {"rerun": 1, "replayed_calls": self.replayed} if self.rerun else {}
        return Episode(
            self.messages,
            self.turns,
            reward,
            self.finish_reason,
            {**(info or {}), **rerun},
            self.prefix_breaks,
            dropped,
            history_edits=dict(self.history_edits),
            env_s=max(0.0, wall_s - self.generate_s),
            generate_s=self.generate_s,
        )

    def _new_sample(self, prompt_ids: list[int], seen: SampleHistory) -> int:
        self.samples.append(TrajectorySample(list(prompt_ids)))
        self.seen.append(seen)
        return len(self.samples) - 1

    def count(self, kinds: set[str]) -> None:
        for kind in kinds or {"other"}:
            self.history_edits[kind] = self.history_edits.get(kind, 0) + 1


@dataclass(frozen=True)
class PendingTurn:
    """A request's place in its episode until its answer is recorded."""

    episode_id: str
    sample: int
    context: list[int]  # the prompt's exact ids
    rendered: str  # the template text of the prompt (with any forced start of the turn)
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sent: list[dict[str, Any]]  # the agent's messages, before the server added a tools message
    replayed: ModelCall | None = None  # a re-run episode's recorded answer to exactly this prompt
    started: float = field(default_factory=time.monotonic)  # when the request reached the recorder

    @property
    def cache_key(self) -> str:
        return f"record:{self.episode_id}:{self.sample}"


def _extend(sample: TrajectorySample, ids: list[int]) -> None:
    """Inserted (not generated) tokens at the end of a sample's context."""
    if not sample.response:
        sample.prompt_ids += ids
        return
    n = len(ids)
    sample.add(ids, [0.0] * n, [sample.versions[-1]] * n, [sample.cache_versions[-1]] * n, generated=False)


class EpisodeRecorder:
    """Every recorded episode by id, until it is taken."""

    def __init__(self, tokenizer: Any, max_episodes: int = 100_000, ids_from_callers: bool = False) -> None:
        """``ids_from_callers``: the episode ids are the callers' own (``serve-rollout --record``), so
        one may be used again by mistake: a new conversation on an id that already holds a finished
        recording is warned about, once per id (a run names each episode itself)."""
        self.renderer = ChatRenderer(tokenizer)
        self.max_episodes = max_episodes
        self.episodes: dict[str, RecordedEpisode] = {}
        self.suspended = False
        self.ids_from_callers = ids_from_callers
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def suspend(self) -> None:
        """A checkpoint: every model call from now on is refused (:class:`EpisodesSuspended`), and
        calls the engines cut are not recorded, until :meth:`resume`."""
        with self._lock:
            self.suspended = True

    def resume(self) -> None:
        with self._lock:
            self.suspended = False

    def replay(self, saved: RecordedCalls) -> None:
        """Answer the re-run of a suspended episode from its recorded calls while its prompts are
        exactly theirs (:class:`~postrl.types.episode.RecordedCalls`)."""
        with self._lock:
            self.episodes[saved.episode_id] = RecordedEpisode(replay=list(saved.calls), rerun=True)

    def saved_calls(self, episode_id: str) -> RecordedCalls:
        """A suspended episode's completed calls (the episode is dropped: its re-run records it again)."""
        with self._lock:
            ep = self.episodes.pop(episode_id, None)
        return RecordedCalls(episode_id, [] if ep is None else ep.calls)

    def prompt(
        self,
        episode_id: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        prefix: str = "",
        sent: list[dict[str, Any]] | None = None,
    ) -> PendingTurn:
        """The exact prompt of this request of the episode (see the module docstring); ``prefix``
        is text the model's turn is started with; ``sent``: the agent's messages where the server
        changed them before rendering (a tools system message added), else ``messages``."""
        sent = list(messages if sent is None else sent)
        full = self.renderer.render(messages, generation_prompt=True, tools=tools) + prefix
        with self._lock:
            if self.suspended:
                raise EpisodesSuspended("a checkpoint suspended the episodes; the run re-runs this one afterwards")
            if episode_id not in self.episodes and len(self.episodes) >= self.max_episodes:
                raise ValueError(f"{self.max_episodes} episodes are recorded and not taken yet")
            ep = self.episodes.setdefault(episode_id, RecordedEpisode())
            reused = self._reused(episode_id, ep, messages)
            index, text, rendered, rendered_tools = self._place(ep, full, list(messages), sent, tools, prefix)
            ep.busy.add(index)
            ep.messages = list(messages)
            context = list(ep.samples[index].context)
            replayed = None
            if ep.replay and ep.replay[0].prompt_ids == context:
                replayed = ep.replay.pop(0)
                ep.replayed += 1
            else:
                ep.replay = []  # the re-run asked something else: the engine answers from here on
        if reused:
            log.warning(
                "episode %s already holds a recording of %d model calls, and this call starts a new conversation in "
                "it (a prefix break in that recording): give a new episode its own id, or take the old recording "
                "first (DELETE /v1/episodes/%s)",
                episode_id,
                reused,
                episode_id,
            )
        return PendingTurn(episode_id, index, context, text, rendered, rendered_tools, sent, replayed)

    def _reused(self, episode_id: str, ep: RecordedEpisode, messages: list[dict[str, Any]]) -> int:
        """The recorded calls of an episode a caller seems to use again (0: not so): a conversation
        with no model turn yet, on an id whose recording has model calls and none in flight."""
        fresh = not any(m.get("role") == "assistant" for m in messages)
        if not (self.ids_from_callers and fresh and ep.calls and not ep.busy and episode_id not in self._warned):
            return 0
        self._warned.add(episode_id)
        return len(ep.calls)

    def _place(
        self,
        ep: RecordedEpisode,
        full: str,
        messages: list[dict[str, Any]],
        sent: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        prefix: str,
    ) -> tuple[int, str, list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(the sample the request goes to, the text of its prompt, the messages and tools that text
        renders): by text, by message, or a new sample (the module docstring's rules)."""
        continued = [i for i, h in enumerate(ep.seen) if full.startswith(h.seen)]
        idle = [i for i in continued if i not in ep.busy]
        if idle:
            index = max(idle, key=lambda i: len(ep.seen[i].seen))
            self._continue(ep, index, full)
            return index, full, messages, tools
        if continued:
            shared = max(continued, key=lambda i: len(ep.seen[i].seen))
            delta = self.renderer.encode(full[len(ep.seen[shared].seen) :])
            ep.forks += 1
            return ep._new_sample(ep.samples[shared].context + delta, SampleHistory(full)), full, messages, tools
        matched = [i for i, h in enumerate(ep.seen) if i not in ep.busy and h.sent and continues(h.sent, sent)]
        if matched:
            index = max(matched, key=lambda i: len(ep.seen[i].sent))
            h = ep.seen[index]
            as_recorded = h.rendered + sent[len(h.sent) :]
            text = self.renderer.render(as_recorded, generation_prompt=True, tools=h.tools) + prefix
            if text.startswith(h.seen):
                dropped = h.tools != tools or h.rendered[0] != messages[0]
                ep.count(edits(h.sent, sent) | ({"tools_dropped"} if dropped else set()))
                self._continue(ep, index, text)
                return index, text, as_recorded, h.tools
            said = [m["content"] for m in h.rendered if m["role"] == "assistant" and isinstance(m.get("content"), str)]
            if any(without_reasoning(c) != c for c in said):
                ep.count({"reasoning_split"})  # the template drops earlier reasoning: the model sees its text
                return ep._new_sample(self.renderer.encode(full), SampleHistory(full)), full, messages, tools
        ep.prefix_breaks += bool(ep.samples)
        return ep._new_sample(self.renderer.encode(full), SampleHistory(full)), full, messages, tools

    def _continue(self, ep: RecordedEpisode, index: int, text: str) -> None:
        """The sample ``index`` extended by the tokens of ``text`` after what it already stands for."""
        delta = self.renderer.encode(text[len(ep.seen[index].seen) :])
        _extend(ep.samples[index], delta)
        if ep.turns:
            ep.turns[-1].observation_tokens = len(delta)
        ep.seen[index] = SampleHistory(text)

    def record(self, turn: PendingTurn, rollouts: list[Rollout], replies: list[dict[str, Any]]) -> None:
        """The engine's responses to ``turn`` (the first continues its sample, each further one forks
        a sample from the same prompt) and the assistant message returned for each, in template form."""
        with self._lock:
            ep = self.episodes[turn.episode_id]
            ep.busy.discard(turn.sample)
            if self.suspended or any(r.finish_reason == "suspended" for r in rollouts):
                return  # cut by a checkpoint: the episode's re-run makes this call again
            ep.generate_s += time.monotonic() - turn.started
            ep.calls.append(
                ModelCall(
                    list(turn.context),
                    [list(r.response_ids) for r in rollouts],
                    [list(r.logprobs) for r in rollouts],
                    [list(r.logprob_versions or [r.weight_version] * len(r.response_ids)) for r in rollouts],
                    [
                        list(r.kv_versions or r.logprob_versions or [r.weight_version] * len(r.response_ids))
                        for r in rollouts
                    ],
                    [r.finish_reason for r in rollouts],
                    rollouts[0].weight_version if rollouts else 0,
                )
            )
            for k, (rollout, reply) in enumerate(zip(rollouts, replies, strict=True)):
                if rollout.prompt_ids != turn.context:
                    raise ValueError(
                        f"episode {turn.episode_id}: the engine answered another prompt than the recorded one"
                    )
                index = turn.sample if k == 0 else ep._new_sample(turn.context, SampleHistory(turn.rendered))
                ep.forks += k > 0
                sample = ep.samples[index]
                own = rollout.logprob_versions or [rollout.weight_version] * len(rollout.response_ids)
                ep.turns.append(Turn(len(sample.context), len(rollout.response_ids), tool_calls=calls_in(reply)))
                sample.add(rollout.response_ids, rollout.logprobs, own, rollout.kv_versions or own, generated=True)
                seen = self._seen_after(turn, rollout, reply)
                ep.seen[index] = SampleHistory(seen, [*turn.sent, reply], [*turn.messages, reply], turn.tools)
                ep.finish_reason = rollout.finish_reason
            if replies and (not ep.messages or ep.messages[-1].get("role") != "assistant"):
                ep.messages = [*ep.messages, replies[0]]  # the transcript ends with the model's last answer

    def release(self, turn: PendingTurn) -> None:
        """A turn that produced nothing (its generation failed): the sample is free again."""
        with self._lock:
            ep = self.episodes.get(turn.episode_id)
            if ep is not None:
                ep.busy.discard(turn.sample)

    def _seen_after(self, turn: PendingTurn, rollout: Rollout, reply: dict[str, Any]) -> str:
        """The template text a sample's context stands for after the model's turn: the template's
        rendering of the returned message, up to where the generated tokens end; where the template
        renders it otherwise than after the prompt, the prompt's text plus the decoded tokens."""
        content, seen = self.renderer.model_turn(rollout.response_ids, stopped=rollout.finish_reason == "stop")
        ended_by = seen[len(content) :]  # the end-of-turn text the model's stop token stands for
        rendered = self.renderer.render([*turn.messages, reply], generation_prompt=False, tools=turn.tools)
        tail = self.renderer.end_of_turn()
        if tail and rendered.startswith(turn.rendered) and rendered.endswith(tail):
            return rendered[: len(rendered) - len(tail)] + ended_by
        return turn.rendered + seen

    def generated_tokens(self, episode_id: str) -> int:
        """The tokens the engine generated in the episode's recorded calls so far (0: no such episode)."""
        with self._lock:
            ep = self.episodes.get(episode_id)
            return 0 if ep is None else sum(len(ids) for call in ep.calls for ids in call.response_ids)

    def take(self, episode_id: str) -> RecordedEpisode | None:
        with self._lock:
            return self.episodes.pop(episode_id, None)

    def view(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's samples as JSON (``GET /v1/episodes/{id}``)."""
        ep = self.episodes.get(episode_id)
        if ep is None:
            return None
        samples = [
            {
                "prompt_ids": s.prompt_ids,
                "response_ids": s.response,
                "logprobs": s.logprobs,
                "loss_mask": s.mask,
                "versions": s.versions,
            }
            for s in ep.samples
        ]
        return {
            "episode_id": episode_id,
            "samples": samples,
            "turns": len(ep.turns),
            "prefix_breaks": ep.prefix_breaks,
            "history_edits": dict(ep.history_edits),
            "forks": ep.forks,
        }


def calls_in(reply: dict[str, Any]) -> list[ToolCallRecord]:
    """The tool calls of a returned assistant message in template form (arguments an object where
    they parsed as one, else the string: None here). The framework runs them, so their outcome is not
    known here: ``error`` stays None."""
    records = []
    for call in reply.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        records.append(ToolCallRecord(call["function"]["name"], arguments if isinstance(arguments, dict) else None))
    return records
