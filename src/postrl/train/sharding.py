"""Splitting a mini-batch across the ranks of a train group by tokens, not by rows.

A rank's work is its tokens, so rows are dealt so that every rank gets about the same number of
tokens to run (a group's prompt counted once, as its rows share one prompt forward); the samples of one group (one prompt) stay on one rank while there are at least as
many groups as ranks, so they can still share one prompt forward.
"""

from __future__ import annotations

import torch

from postrl.train.micro_batching import row_costs
from postrl.types import ExperienceBatch


def split_rows_by_tokens(batch: ExperienceBatch, ranks: int) -> list[torch.Tensor]:
    """Row indices per rank: units (groups, or single rows when there are fewer groups than ranks)
    go, heaviest first, to the rank with the fewest tokens so far (ties to the lower rank). Every
    rank computes the same split from the same batch."""
    prompts, tails = row_costs(batch)
    units: dict[int, list[int]] = {}
    for row, group in enumerate(batch.group_ids.tolist()):
        units.setdefault(group, []).append(row)
    members = list(units.values())
    if len(members) < ranks:
        members = [[row] for row in range(batch.size)]
    weights = [prompts[unit[0]] + sum(tails[r] for r in unit) for unit in members]  # the prompt runs once
    order = sorted(range(len(members)), key=lambda u: (-weights[u], u))
    loads = [0] * ranks
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    for u in order:
        rank = min(range(ranks), key=lambda k: (loads[k], k))
        loads[rank] += weights[u]
        assigned[rank].extend(members[u])
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in assigned]
