"""Rollout engine hosts for tests: one that is slow to answer, so it can be killed mid-call."""

from __future__ import annotations

import time

from postrl.rollout.host import RolloutEngineHost


class SlowHost(RolloutEngineHost):
    def generate(self, prompts, sampling_params, weight_version):
        time.sleep(1.5)
        return self.target.generate(prompts, sampling_params, weight_version)


class Refusing:
    """A worker whose calls raise: a registered error type, and an unregistered one."""

    accuracy_component = "acc"

    def update_weights(self, *args):
        from postrl.models.weights import WeightSyncError

        raise WeightSyncError("manifest mismatch: 1 tensors altered")

    def broken(self):
        raise KeyError("no such tensor")
