"""The teachers of a run (``algorithm.distill``): built once, checked against the student's
tokenizer at start, each sample routed to the teacher of its task, each answer kept so that no
sample is asked about twice."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from postrl.config.distill import DistillConfig, TeacherConfig, is_url
from postrl.models.loading import ModelNotFoundError
from postrl.train.teachers.teacher import Teacher, TokenizerMismatchError
from postrl.types.progress import phase
from postrl.types.teaching import TeacherAnswer, TeacherCounts, TeacherFailure, TeacherQuery

# what the tokenizer check tokenizes: words, digits, operators, code, whitespace runs and a newline
# (short: a character-level tokenizer makes one token of each character)
PART = 64  # queries per teacher call: a long pass reports its progress between them

PROBE = "The fox, 13 dogs: 4+5=9, 12*34=408.\n\tdef f(x):  return x**2  # ok?"


class TeacherSet:
    """The run's teachers by name, in ``config.teachers`` order (a :class:`~postrl.workers.roles.Teachers`)."""

    def __init__(self, config: DistillConfig, teachers: list[Teacher], cache_size: int = 16384) -> None:
        if len(teachers) != len(config.teachers):
            raise ValueError(f"{len(config.teachers)} teachers configured, {len(teachers)} given")
        self.config = config
        self.names = [config.name_of(i) for i in range(len(teachers))]
        self.teachers = teachers
        self.cache: OrderedDict[tuple[int, str], list[float]] = OrderedDict()
        self.cache_size = cache_size

    def teacher_of(self, task_type: Any) -> int | None:
        return self.config.teacher_for(task_type)

    def logprobs(self, owners: list[int], queries: list[TeacherQuery]) -> tuple[list[TeacherAnswer], TeacherCounts]:
        """The answer to each query from teacher ``owners[i]``: the kept one, else asked (each teacher
        once, with each of its distinct queries once). Failures are not kept: a later step may ask again."""
        answers: dict[tuple[int, str], TeacherAnswer] = {}
        counts = TeacherCounts({name: 0 for name in self.names})
        keys = [(owner, _digest(q)) for owner, q in zip(owners, queries, strict=True)]
        for key in keys:
            if key in self.cache:
                self.cache.move_to_end(key)
                answers[key] = self.cache[key]
                counts.kept += 1
        for index in range(len(self.teachers)):
            mine = {key: queries[i] for i, key in enumerate(keys) if key[0] == index and key not in answers}
            if not mine:
                continue
            counts.asked[self.names[index]] += len(mine)
            for key, answer in zip(mine, self._ask(index, list(mine.values())), strict=True):
                answers[key] = answer
                if not isinstance(answer, TeacherFailure):
                    self._keep(key, answer)
        return [answers[key] for key in keys], counts

    def _ask(self, index: int, queries: list[TeacherQuery]) -> list[TeacherAnswer]:
        """Teacher ``index``'s answers, asked in parts (``PART`` queries, or 4 per request a URL teacher
        keeps in flight) so that a long pass shows its progress between them."""
        answers: list[TeacherAnswer] = []
        size = max(PART, 4 * self.config.teachers[index].concurrency)
        name = self.names[index]
        with phase("teacher" if name == "teacher" else f"teacher {name}", len(queries), "samples") as shown:
            for at in range(0, len(queries), size):
                part = queries[at : at + size]
                answers += self.teachers[index].logprobs(part)
                shown.advance(len(part), sum(len(q.ids) - q.start for q in part))
        return answers

    def _keep(self, key: tuple[int, str], answer: list[float]) -> None:
        self.cache[key] = answer
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)

    def close(self) -> None:
        for teacher in self.teachers:
            teacher.close()


def _digest(query: TeacherQuery) -> str:
    data = torch.tensor(query.ids, dtype=torch.int64).numpy().tobytes() + query.start.to_bytes(8, "little")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def check_tokenizer(teacher: Teacher, where: str, tokenizer: Any, student: str) -> None:
    """The teacher must split text as the student does and read the student's token ids as the same
    strings; else a :class:`TokenizerMismatchError` naming both."""
    ids = tokenizer(PROBE)["input_ids"]
    decoded = [tokenizer.decode([i]) for i in ids]
    raw = tokenizer.convert_ids_to_tokens(ids)  # a server may name tokens by their vocabulary entries
    split, read = teacher.tokenization(PROBE), teacher.pieces(ids)
    for what, theirs in (("splits the probe text", split), ("reads the student's token ids", read)):
        if theirs not in (decoded, raw):
            ours = decoded if len(theirs) != len(raw) else raw
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise TokenizerMismatchError(
                f"{where} ({teacher.source}) does not share the student's tokenizer (model.path={student}): it "
                f"{what} into {len(theirs)} tokens against the student's {len(ours)}, first differing at token {at} "
                f"({theirs[at : at + 3]!r} against {ours[at : at + 3]!r}); distillation needs one tokenizer for both"
            )


def make_teacher(config: TeacherConfig, device: torch.device, temperature: float, micro_batch_size: int) -> Teacher:
    if is_url(config.source):
        from postrl.train.teachers.http_teacher import HTTPTeacher

        return HTTPTeacher(config.source, config.model, config.timeout_s, config.api_key_env, config.concurrency)
    from postrl.train.teachers.local_teacher import LocalTeacher

    return LocalTeacher(config.source, config.dtype, device, temperature, micro_batch_size)


def make_teachers(
    config: DistillConfig,
    tokenizer: Any,
    student: str,
    device: torch.device,
    temperature: float,
    micro_batch_size: int,
) -> TeacherSet:
    """Each configured teacher, loaded or connected and its tokenizer checked against the student's."""
    built: list[Teacher] = []
    try:
        for i, teacher_config in enumerate(config.teachers):
            try:
                built.append(make_teacher(teacher_config, device, temperature, micro_batch_size))
            except ModelNotFoundError as exc:  # the student's model.path is fine: say which model is missing
                raise ModelNotFoundError(f"algorithm.distill.teachers[{i}].source: {exc}") from None
            check_tokenizer(built[-1], f"algorithm.distill.teachers[{i}]", tokenizer, student)
    except BaseException:
        for teacher in built:
            teacher.close()
        raise
    return TeacherSet(config, built)


@dataclass(frozen=True)
class TeacherSpec:
    """What builds a run's teachers, wherever the scheduler places them: a folder teacher on the
    trainer's device (``train.device``) at the rollout's temperature, each checked against the
    student's tokenizer (``model.path``)."""

    config: DistillConfig
    student: str
    device: str
    temperature: float
    micro_batch_size: int

    @staticmethod
    def of_run(config: Any) -> TeacherSpec:
        """The teachers of a ``postrl train`` run (a RunConfig with ``algorithm.distill``)."""
        distill = config.algorithm.distill
        if distill is None:
            raise ValueError("teachers need algorithm.distill")
        t = config.train
        return TeacherSpec(distill, config.model.path, t.device, config.rollout.temperature, t.micro_batch_size)

    @property
    def loads_a_model(self) -> bool:
        """Some teacher is a model folder (run where it is placed), not only servers called by URL."""
        return any(not is_url(t.source) for t in self.config.teachers)

    def build(self) -> TeacherSet:
        from postrl.models.devices import resolve_device
        from postrl.models.loading import load_tokenizer

        device = resolve_device(self.device, "train.device")
        tokenizer = load_tokenizer(self.student)
        return make_teachers(self.config, tokenizer, self.student, device, self.temperature, self.micro_batch_size)
