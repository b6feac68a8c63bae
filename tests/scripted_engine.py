"""A rollout engine that answers with scripted texts: for the servers' parsing and recording
tests, where what the model writes must be known."""

from __future__ import annotations

import threading

from postrl.rollout.common import EngineBase
from postrl.types import Rollout


class ScriptedEngine(EngineBase):
    """Answers each generate call with the next scripted texts (one per choice), token by token,
    ending with the template's end-of-turn token; keeps every prompt it was given."""

    streams_tokens = True
    joins_calls = False

    def __init__(self, tokenizer, end_id: int) -> None:
        self.tokenizer, self.end_id = tokenizer, end_id
        self.script: list[str] = []
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()
        self.received = threading.Event()  # set when a generate call has its prompts
        self.gate: threading.Event | None = None  # when set: each generate waits for it to open

    def generate(self, prompts, sampling_params, weight_version, on_token=None):
        out = []
        for i, p in enumerate(prompts):
            with self.lock:
                self.prompts.append(list(p.prompt_ids))
            self.received.set()
            if self.gate is not None:
                self.gate.wait(timeout=30)
            for k in range(sampling_params.n):
                with self.lock:
                    text = self.script.pop(0)
                out.append(self._answer(i, p.prompt_ids, text, sampling_params, k, on_token))
        return out

    def _answer(self, i: int, prompt_ids: list[int], text: str, params, k: int, on_token) -> Rollout:
        """The scripted text as an engine answers it: up to and with the first stop string, or cut at
        max_tokens (finish "length"), else ended by the end-of-turn token."""
        hits = [text.find(s) + len(s) for s in params.stop if s and s in text]
        ids = self.tokenizer(text[: min(hits)] if hits else text, add_special_tokens=False)["input_ids"]
        ids = ids + ([] if hits else [self.end_id])
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        for j, t in enumerate(ids):
            if on_token is not None:
                on_token(i, k, t, -0.5, None, finish if j == len(ids) - 1 else None)
        decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Rollout(i, list(prompt_ids), ids, [-0.5] * len(ids), decoded, finish, self.weight_version)

    def update_weights(self, weights, version, manifest=None):
        self.weight_version = version

    def health_check(self):
        return True

    def health(self):
        from postrl.types import Health

        return Health(True)

    def close(self):
        pass
