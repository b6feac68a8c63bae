"""Which samples each step trained on: a test patches the buffer's ``get`` and the Controller's
``finish_step`` to record, per completed step, the ``(batch, row)`` of every experience taken."""

from __future__ import annotations

from typing import Any


def record_trained_samples(monkeypatch: Any, buffer_class: type) -> dict[int, list[tuple[int, int]]]:
    """Patch ``buffer_class.get`` (the buffer, or its actor's client) and ``Controller.finish_step``;
    the returned dict fills in as steps complete: step -> the samples it trained."""
    from postrl.controller.controller import Controller

    trained: dict[int, list[tuple[int, int]]] = {}
    taken: list[tuple[int, int]] = []
    get, finish = buffer_class.get, Controller.finish_step

    def recording_get(self, batch_size, current_version):
        out = get(self, batch_size, current_version)
        taken.extend((e.metadata["batch"], e.metadata["row"]) for e in out.experiences)
        return out

    def recording_finish(self, *args):
        metrics = finish(self, *args)
        trained[metrics.step] = list(taken)
        taken.clear()
        return metrics

    monkeypatch.setattr(buffer_class, "get", recording_get)
    monkeypatch.setattr(Controller, "finish_step", recording_finish)
    return trained
