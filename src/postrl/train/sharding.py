"""Splitting a mini-batch across the ranks of a train group by tokens, not by rows.

A rank's work is its tokens, so rows are dealt so that every rank gets about the same number of
loss tokens; the samples of one group (one prompt) stay on one rank while there are at least as
many groups as ranks, so they can still share one prompt forward.
"""

from __future__ import annotations

import torch

from postrl.types import ExperienceBatch


def split_rows_by_tokens(batch: ExperienceBatch, ranks: int) -> list[torch.Tensor]:
    """Row indices per rank: units (groups, or single rows when there are fewer groups than ranks)
    go, heaviest first, to the rank with the fewest tokens so far (ties to the lower rank). Every
    rank computes the same split from the same batch."""
    tokens = batch.attention_mask.sum(dim=1).tolist()
    units: dict[int, list[int]] = {}
    for row, group in enumerate(batch.group_ids.tolist()):
        units.setdefault(group, []).append(row)
    members = list(units.values())
    if len(members) < ranks:
        members = [[row] for row in range(batch.size)]
    weights = [sum(tokens[r] for r in unit) for unit in members]
    order = sorted(range(len(members)), key=lambda u: (-weights[u], u))
    loads = [0] * ranks
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    for u in order:
        rank = min(range(ranks), key=lambda k: (loads[k], k))
        loads[rank] += weights[u]
        assigned[rank].extend(members[u])
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in assigned]
