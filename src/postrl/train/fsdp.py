"""The Train Worker as one rank of an FSDP2 group (``fully_shard`` per decoder layer).

Every rank receives the whole batch and makes the same mini-batches (same seeded generator); each
trains on its token-balanced share (:func:`split_rows_by_tokens`). The loss normaliser is the
mini-batch's token (and sequence) count, all-reduced, divided by the number of ranks because FSDP averages the
ranks' gradients (gloo has no pre-scaled sum), so the update equals the one-process update up to
float rounding. Ranks run the same number of
micro-batches (a rank with fewer runs a zero-weight one) because every forward and backward is a
collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from postrl.algorithms import LossNormalizer
from postrl.config.run import AlgorithmConfig, TrainConfig
from postrl.models.weights import dedupe_tied
from postrl.train.lora import base_of, lora_export_state, save_lora_model
from postrl.train.sharding import split_rows_by_tokens
from postrl.train.stats import Stats
from postrl.train.worker import PolicyTrainer
from postrl.types import ExperienceBatch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (``model.model.layers`` and the like)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        node: Any = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, torch.nn.ModuleList):
            return list(node)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def shard_model(model: torch.nn.Module, bf16: bool = False) -> FSDPModule:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, head); returns the
    sharded root. A peft (LoRA) model's decoder layers are found inside its wrapper and the wrapper
    is the root (peft calls its inner model's ``forward`` directly, past any hook there), so frozen
    base weights and trainable adapters share each layer's shards. With ``bf16``
    the forward and backward run in bf16 while the sharded fp32 parameters stay the master copy."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for layer in decoder_layers(base_of(model)):
        fully_shard(layer, mp_policy=policy) if policy is not None else fully_shard(layer)
    root = fully_shard(model, mp_policy=policy) if policy is not None else fully_shard(model)
    assert isinstance(root, FSDPModule)
    return root


class FSDPPolicyTrainer(PolicyTrainer):
    """A :class:`PolicyTrainer` whose model is sharded across the ranks of the default process group."""

    def __init__(
        self,
        model: torch.nn.Module,
        train: TrainConfig,
        algorithm: AlgorithmConfig,
        bf16: bool = False,
        ref_model: torch.nn.Module | None = None,
        **options: Any,
    ) -> None:
        """``options``: the other keyword arguments of :class:`PolicyTrainer`."""
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.sharded = shard_model(model, bf16)
        if ref_model is not None:
            shard_model(ref_model, bf16)
        super().__init__(model, train, algorithm, ref_model=ref_model, is_main=self.rank == 0, **options)

    def micro_batches(self, mini: ExperienceBatch) -> list[tuple[torch.Tensor, ExperienceBatch]]:
        """This rank's micro-batches of ``mini`` (its rows balanced by tokens), padded with rows that
        train nothing so that every rank runs as many forwards as the busiest (they are collectives)."""
        mine = split_rows_by_tokens(mini, self.world)[self.rank].to(mini.input_ids.device)
        part = mini.select(mine)
        local = [(mine[rows], part.select(rows)) for rows in self.micro_batch_rows(part)]
        count = torch.tensor(len(local), device=mini.input_ids.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        nothing = mine[:0]
        return local + [(nothing, zero_weight(mini)) for _ in range(int(count) - len(local))]

    def loss_normalizer(self, mini: ExperienceBatch) -> LossNormalizer:
        """The mini-batch's tokens and sequences over all ranks, divided by the number of ranks:
        FSDP averages the ranks' gradients."""
        part = mini.select(split_rows_by_tokens(mini, self.world)[self.rank].to(mini.input_ids.device))
        counts = torch.stack([part.loss_mask.sum(), (part.loss_mask.sum(dim=-1) > 0).sum().to(part.loss_mask.dtype)])
        dist.all_reduce(counts)
        return LossNormalizer(counts[0] / self.world, counts[1] / self.world, self.max_response_tokens)

    def before_micro_batch(self, index: int, count: int) -> None:
        self.sharded.set_requires_gradient_sync(index == count - 1)  # one gradient reduction per mini-batch

    def reduce_stats(self, stats: Stats) -> Stats:
        return stats.all_reduce()

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Each rank filled its own rows (zeros elsewhere): the sum over ranks is every row."""
        dist.all_reduce(rows)
        return rows

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 (gathered layer by layer to the CPU); an empty dict elsewhere.
        With LoRA the adapters or the merged weights, gathered on every rank (see
        :mod:`postrl.train.lora`). Every rank must call it: the gather is a collective."""
        if self.lora is not None:
            return super().policy_state()
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return dedupe_tied({name: t for name, t in state.items() if isinstance(t, torch.Tensor)})

    def save_pretrained(self, folder: str | Path) -> None:
        if self.lora is not None:
            state = lora_export_state(self.model, self.lora.export)  # a collective: every rank gathers
            if self.is_main:
                save_lora_model(self.model, Path(folder), self.lora.export, state)
            return
        state = self.policy_state()
        if self.is_main:
            save_full_state(self.model, state, Path(folder))


def zero_weight(mini: ExperienceBatch) -> ExperienceBatch:
    """One row of ``mini`` that trains nothing: it only keeps a rank in step with the collectives."""
    row = mini.select(slice(0, 1))
    row.loss_mask = torch.zeros_like(row.loss_mask)
    return row


def save_full_state(model: Any, state: dict[str, torch.Tensor], folder: Path) -> None:
    """A Hugging Face folder from gathered weights. ``fully_shard`` renames the model's class
    (``FSDPLlamaForCausalLM``), so the config names the original architecture."""
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    original = type(model).__mro__[1].__name__ if type(model).__name__.startswith("FSDP") else type(model).__name__
    model.config.architectures = [original]
    model.config.save_pretrained(folder)
