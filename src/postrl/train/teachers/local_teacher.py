"""A teacher run in this process: a Hugging Face model folder, frozen."""

from __future__ import annotations

import torch

from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.train.logprobs import token_logprobs
from postrl.train.teachers.teacher import TeacherAnswer, TeacherFailure, TeacherQuery
from postrl.types.batch import pad_sequences


class LocalTeacher:
    """``source``'s logprob of each response token, by the trainer's own logprob code (its lean
    forward and chunked head; the samples of one prompt run it once), ``micro_batch_size`` samples
    at a time, at ``temperature`` (the rollout's, so that teacher and student logprobs are of the
    same tempered distributions)."""

    def __init__(
        self, source: str, dtype: str, device: torch.device, temperature: float, micro_batch_size: int
    ) -> None:
        self.source = source
        self.model = load_causal_lm(source, dtype).to(device).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(source)
        self.device = device
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size

    def logprobs(self, queries: list[TeacherQuery]) -> list[TeacherAnswer]:
        answers: list[TeacherAnswer] = []
        for at in range(0, len(queries), self.micro_batch_size):
            chunk = queries[at : at + self.micro_batch_size]
            try:
                answers.extend(self._chunk(chunk))
            except (RuntimeError, ValueError) as exc:  # e.g. out of memory: these samples, not the run
                answers.extend(TeacherFailure(f"teacher {self.source}: {type(exc).__name__}: {exc}") for _ in chunk)
        return answers

    def _chunk(self, queries: list[TeacherQuery]) -> list[list[float]]:
        for q in queries:
            if not 0 < q.start <= len(q.ids):
                raise ValueError(f"a query's response starts at {q.start}, outside its {len(q.ids)} tokens")
        padded = pad_sequences([(q.ids[: q.start], q.ids[q.start :]) for q in queries], pad_id=0)
        prompts: dict[tuple[int, ...], int] = {}  # samples of one prompt run it once (the lean forward's groups)
        groups = torch.tensor([prompts.setdefault(tuple(q.ids[: q.start]), len(prompts)) for q in queries])
        with torch.no_grad():
            logp, _ = token_logprobs(
                self.model,
                padded.input_ids.to(self.device),
                padded.attention_mask.to(self.device),
                self.temperature,
                target_mask=padded.response_mask.to(self.device),
                group_ids=groups.to(self.device),
            )
        logp = logp.float().cpu()
        return [logp[row, span].tolist() for row, span in enumerate(padded.spans)]

    def tokenization(self, text: str) -> list[str]:
        return self.pieces(self.tokenizer(text)["input_ids"])

    def pieces(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]

    def close(self) -> None:
        del self.model
