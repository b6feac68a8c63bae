"""Reaching a worker: one client made from its role's Protocol, checked at start-up; a method added
to a role needs its Protocol and its implementation only, wherever the worker runs."""

from __future__ import annotations

import pytest
import torch

from postrl.config.run import AlgorithmConfig
from postrl.train.factory import PolicySpec, build_train_worker
from postrl.train.group import TrainGroup
from postrl.workers.clients import RoleMismatchError, client, role_members
from postrl.workers.handles import InProcessHandle
from postrl.workers.roles import ExperienceStore, RewardService, TrainWorker
from tests.role_probe import EvaluatingTrainWorker, ProbeRank
from tests.test_fsdp import TRAIN, group_of, uneven_batch


def test_a_client_has_exactly_its_protocols_methods_and_attributes():
    assert role_members(TrainWorker) == (
        ["close", "load_checkpoint", "policy_state", "reference_logprobs", "save_checkpoint", "save_pretrained",
         "set_kl_beta", "update"],
        [],
    )  # fmt: skip
    assert role_members(RewardService)[1] == ["accuracy_component"]
    assert "__len__" in role_members(ExperienceStore)[0]
    assert role_members(EvaluatingTrainWorker)[0] == sorted([*role_members(TrainWorker)[0], "evaluate"])


def test_a_worker_without_a_method_of_its_role_fails_when_its_client_is_made():
    class Partial:
        def update(self, batch):
            return None

    with pytest.raises(RoleMismatchError) as err:
        client(InProcessHandle(Partial(), "train worker"), TrainWorker)
    message = str(err.value)
    assert message.startswith("train worker is placed as a TrainWorker but has no close, load_checkpoint, ")
    assert "update" not in message


@pytest.mark.slow
def test_a_method_added_to_the_role_reaches_the_worker_in_this_process_and_in_a_group_of_ranks(
    tiny_model_dir, char_tokenizer
):
    """The new ``evaluate`` (tests/role_probe.py: the Protocol and the implementation) answers through
    an in-process client and through a 2-rank FSDP group (hosts, TrainGroup and client unchanged),
    with the same value."""
    batch = uneven_batch(char_tokenizer.pad_token_id)
    policy = PolicySpec(str(tiny_model_dir), "float32", TRAIN, AlgorithmConfig(), temperature=1.0, seed=0)
    here = client(InProcessHandle(build_train_worker(policy, torch.device("cpu")), "worker"), EvaluatingTrainWorker)
    ranks = group_of(2, tiny_model_dir, factory=ProbeRank)
    group = client(TrainGroup(ranks), EvaluatingTrainWorker)
    try:
        want, got = here.evaluate(batch), group.evaluate(batch)
        assert want < 0 and abs(got - want) <= 1e-5, (got, want)
    finally:
        group.close()
