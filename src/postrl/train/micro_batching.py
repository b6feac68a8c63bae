"""Micro-batches by a token budget (``train.micro_batch_tokens``) instead of a row count.

The work of a forward is its tokens, and the samples of one group (one prompt) share one prompt
forward (:func:`postrl.train.logprobs.pack_shared_prompts`), so a group costs its prompt once plus
its responses. Whole groups are dealt, heaviest first, to the micro-batch with the fewest tokens
that still has room, over as few micro-batches as the budget allows: the micro-batches come out
about equally heavy. A group heavier than the budget is cut into runs of its rows that fit (each
run pays the prompt again); a single row heavier than the budget is a micro-batch of its own.

The split changes nothing but the order of the arithmetic: the loss of every micro-batch is
normalised by the whole mini-batch's token count (:meth:`PolicyTrainer.loss_normalizer`).
"""

from __future__ import annotations

import math

import torch

from postrl.types import ExperienceBatch


def row_costs(batch: ExperienceBatch) -> tuple[list[int], list[int]]:
    """Each row's (prompt tokens, tokens after the prompt): the prompt ends where the first
    response logprob is predicted; a row with no response is all prompt."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    has_response = batch.response_mask.sum(dim=1) > 0
    first = (batch.response_mask > 0).float().argmax(dim=1) + 1
    prompts = torch.where(has_response, first, batch.attention_mask.sum(dim=1)).tolist()
    return [int(p) for p in prompts], [int(n) - int(p) for n, p in zip(lengths, prompts)]


def _units(batch: ExperienceBatch, budget: int) -> list[tuple[list[int], int]]:
    """Groups (or runs of a group's rows when the group exceeds ``budget``) with their token cost."""
    prompts, tails = row_costs(batch)
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(batch.group_ids.tolist()):
        groups.setdefault(group, []).append(row)
    units: list[tuple[list[int], int]] = []
    for rows in groups.values():
        run: list[int] = []
        cost = 0
        for row in rows:
            extra = tails[row] + (prompts[row] if not run else 0)
            if run and cost + extra > budget:
                units.append((run, cost))
                run, cost, extra = [], 0, prompts[row] + tails[row]
            run.append(row)
            cost += extra
        units.append((run, cost))
    return units


def token_budget_micro_batches(batch: ExperienceBatch, budget: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch of ``batch`` under ``budget`` tokens, about equally heavy.

    Deterministic: every rank computes the same split from the same batch."""
    if budget < 1:
        raise ValueError(f"train.micro_batch_tokens must be >= 1, got {budget}")
    if batch.size == 0:
        return []
    units = _units(batch, budget)
    order = sorted(range(len(units)), key=lambda u: (-units[u][1], u))
    count = max(1, math.ceil(sum(cost for _, cost in units) / budget))
    loads = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    for u in order:
        rows, cost = units[u]
        fits = [k for k in range(len(loads)) if loads[k] + cost <= budget or not members[k]]
        if not fits:
            loads.append(0)
            members.append([])
            fits = [len(loads) - 1]
        k = min(fits, key=lambda b: (loads[b], b))
        loads[k] += cost
        members[k].extend(rows)
    device = batch.input_ids.device
    return [torch.tensor(sorted(rows), dtype=torch.long, device=device) for rows in members if rows]


def packed_tokens(batch: ExperienceBatch) -> int:
    """Tokens a forward over ``batch`` runs when each group's prompt is run once."""
    return sum(cost for _, cost in _units(batch, budget=2**62))
