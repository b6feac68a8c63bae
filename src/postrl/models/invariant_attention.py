"""Batch-invariant attention (:mod:`postrl.models.invariant`'s rules for attention): float32 over
fixed blocks of :data:`KEY_BLOCK` key positions of a query's own sequence, queries grouped in items
of one sequence, each item's scores one product whose rows and columns do not depend on how many
share it, the softmax maximum first, then each block's ``exp`` sums and weighted values added in
block order. Keys after a query's position contribute exact zeros, so a query reads the same
numbers whether its sequence is 10 or 1,000 tokens long in the call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from postrl.models.invariant import fixed_batches

KEY_BLOCK = 64
QUERY_TOKENS = 16  # queries of one sequence per attention item, at most
MIN_ITEM_ROWS = 4  # an item's product rows (queries x query heads per KV head), at least (1-2 rows take another kernel)
ITEM_CHUNK = 256  # attention items per batch of products (a GPU's batch is padded to it)
# scores further than this below their row's maximum count as exactly that far: exp of them stays a
# normal float (e^-80 = 1.8e-35; a subnormal result, or exp(-inf), takes the CPU 13-70x longer)
EXP_FLOOR = -80.0


@dataclass(frozen=True)
class QueryItems:
    """Queries grouped for :func:`attention`: item ``i`` is up to ``per_item`` queries of sequence
    ``seq[i]`` (rows ``index[i]`` of the queries, ``T`` for padding, at positions ``pos[i]``, 0 for
    padding); query ``t`` is flat slot ``slot[t]`` of ``[items * per_item]``. Built once per forward
    and used by every layer.

    ``per_item`` is :data:`QUERY_TOKENS`, or 1 when every sequence has one query in the call (a
    decode step): the products' rows do not depend on how many there are (tested), so a decode
    step's items need not carry 15 empty queries each. A decode step's items are then one per
    sequence of the run ``first_seq, first_seq + 1, ..`` (a padding item where a sequence has no
    query), so each key block is a view of the cache, not a copy."""

    index: torch.Tensor  # [items, per_item]
    seq: torch.Tensor  # [items]
    pos: torch.Tensor  # [items, per_item]
    slot: torch.Tensor  # [T]
    blocks: int  # key blocks the furthest query reaches
    first_seq: int | None = None  # items are sequences first_seq, first_seq + 1, ... in order

    @property
    def per_item(self) -> int:
        return self.index.shape[1]


def query_items(sequence: torch.Tensor, position: torch.Tensor) -> QueryItems:
    """Each sequence's queries (``sequence[t]``, at ``position[t]``), in order, in items of
    :data:`QUERY_TOKENS`; one item per sequence of their range where each has one query."""
    by_sequence: dict[int, list[int]] = {}
    for t, s in enumerate(sequence.tolist()):
        by_sequence.setdefault(s, []).append(t)
    total = len(sequence)
    one_each = bool(by_sequence) and all(len(rows) == 1 for rows in by_sequence.values())
    fixed = fixed_batches(sequence.device)  # a GPU's items always hold QUERY_TOKENS (fixed shapes)
    first_seq = min(by_sequence) if one_each and not fixed else None
    if first_seq is not None:
        seq = list(range(first_seq, max(by_sequence) + 1))
        index = [by_sequence.get(s, [total]) for s in seq]
    else:
        per_item = 1 if one_each and not fixed else QUERY_TOKENS
        index, seq = [], []
        for s, rows in by_sequence.items():
            for a in range(0, len(rows), per_item):
                part = rows[a : a + per_item]
                index.append(part + [total] * (per_item - len(part)))
                seq.append(s)
    device = sequence.device
    index_t = torch.tensor(index, dtype=torch.long, device=device).view(len(index), -1)
    padded_pos = torch.cat([position, position.new_zeros(1)])
    slot = torch.empty(total, dtype=torch.long, device=device)
    flat = index_t.reshape(-1)
    real = flat < total
    slot[flat[real]] = torch.arange(flat.numel(), device=device)[real]
    reach = int(position.max()) + 1 if total else 1
    seq_t = torch.tensor(seq, dtype=torch.long, device=device)
    return QueryItems(index_t, seq_t, padded_pos[index_t], slot, -(-reach // KEY_BLOCK), first_seq)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, items: QueryItems) -> torch.Tensor:
    """Causal attention of queries ``q`` ``[T, heads, head_dim]`` (grouped by :func:`query_items`):
    query ``t`` attends to positions ``0 .. position[t]`` of its sequence in ``keys``/``values``
    ``[S, kv_heads, L, head_dim]`` (a KV cache's layout; the query's own key already written).
    Returns ``[T, heads * head_dim]`` in ``q``'s dtype.

    Per item and KV head, the scores are ``[rows, head_dim] x [head_dim, keys]`` products (one over
    all keys on the CPU, one per key block on a GPU) and the weighted values one ``[rows, KEY_BLOCK]
    x [KEY_BLOCK, head_dim]`` product per block (``rows``: the item's queries times the query heads
    of a KV head, at least :data:`MIN_ITEM_ROWS`), in batches of such: products whose rows do not
    depend on each other, on the row or key count or on the batch (tested). Blocks after a query's
    position add exact zeros (see :func:`_attend_items`)."""
    total, heads, head_dim = q.shape
    padded = torch.cat([q, q.new_zeros(1, heads, head_dim)]).float()
    per_item = items.per_item
    outputs = []
    for a in range(0, items.index.shape[0], ITEM_CHUNK):
        index, seq, pos = items.index[a : a + ITEM_CHUNK], items.seq[a : a + ITEM_CHUNK], items.pos[a : a + ITEM_CHUNK]
        short = ITEM_CHUNK - index.shape[0]
        if short and fixed_batches(q.device):  # cuBLAS picks its algorithm by the batch size too
            index = torch.cat([index, index.new_full((short, per_item), total)])
            seq, pos = torch.cat([seq, seq.new_zeros(short)]), torch.cat([pos, pos.new_zeros(short, per_item)])
        first = None if items.first_seq is None else items.first_seq + a
        out = _attend_items(padded, keys, values, index, seq, pos, items.blocks, first)
        outputs.append(out[: ITEM_CHUNK - short] if short and fixed_batches(q.device) else out)
    flat = torch.cat(outputs).reshape(-1, heads * head_dim)
    return flat.index_select(0, items.slot).to(q.dtype)


def _attend_items(
    padded_q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    blocks: int,
    first_seq: int | None,
) -> torch.Tensor:
    """``[items, per_item, heads, head_dim]`` float32 attention of a batch of items (padding slots:
    a zero query at position 0, which reads key 0 alone and is cut later); ``first_seq``: the items
    are sequences ``first_seq ..`` in order (see :class:`QueryItems`).

    The scores of an (item, KV head) are one product over all its keys on the CPU (a score's
    rounding does not depend on how many keys share its product, tested), on a GPU one product per
    key block (its kernels choose their configuration by the shape). The softmax's sums are per
    (row, key block), over :data:`KEY_BLOCK` contiguous weights, and so are the weighted values'
    products; the blocks' sums are added in block order."""
    n_items, per_item = index.shape
    heads, head_dim = padded_q.shape[1], padded_q.shape[2]
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    width = per_item * groups
    rows = max(width, MIN_ITEM_ROWS)
    # [items, per_item, kv, groups, d] -> [items, kv, rows, d], scaled
    qi = padded_q.index_select(0, index.reshape(-1)).view(n_items, per_item, kv_heads, groups, head_dim)
    qi = qi.permute(0, 2, 1, 3, 4).reshape(n_items, kv_heads, width, head_dim) * head_dim**-0.5
    query_pos = pos[:, None, :, None].expand(n_items, 1, per_item, groups).reshape(n_items, 1, width, 1, 1)
    if rows > width:
        qi = F.pad(qi, (0, 0, 0, rows - width))
        query_pos = F.pad(query_pos, (0, 0, 0, 0, 0, rows - width))
    k_all, v_all = _blocks(keys, seq, blocks, first_seq), _blocks(values, seq, blocks, first_seq)
    n_blocks = k_all.shape[2]
    s = _scores(qi.reshape(-1, rows, head_dim), k_all).view(n_items, kv_heads, rows, n_blocks, KEY_BLOCK)
    key_pos = torch.arange(n_blocks * KEY_BLOCK, device=padded_q.device).view(n_blocks, KEY_BLOCK)
    masked = key_pos > query_pos
    s = s.masked_fill_(masked, float("-inf"))
    top = s.amax((3, 4), keepdim=True)
    e = torch.exp((s - top).clamp_(min=EXP_FLOOR)).masked_fill(masked, 0.0)
    parts = e.sum(-1)  # [items, kv, rows, blocks]
    e_blocks = e.permute(0, 1, 3, 2, 4).contiguous()  # [items, kv, blocks, rows, KEY_BLOCK]
    weighted = _weighted(e_blocks, v_all).view(n_items, kv_heads, n_blocks, rows, head_dim)
    total, out = parts[..., 0], weighted[:, :, 0]
    for j in range(1, n_blocks):  # in block order
        total, out = total + parts[..., j], out + weighted[:, :, j]
    result = (out / total[..., None])[:, :, :width]
    return result.reshape(n_items, kv_heads, per_item, groups, head_dim).permute(0, 2, 1, 3, 4)


def _scores(q: torch.Tensor, k_all: torch.Tensor) -> torch.Tensor:
    """``[items * kv, rows, blocks * KEY_BLOCK]`` scores of queries ``q`` ``[items * kv, rows, d]``
    against keys ``k_all`` ``[items, kv, blocks, KEY_BLOCK, d]``: on the CPU one product per
    (item, KV head) over all its keys, on a GPU one batch of products per block."""
    n_blocks, head_dim = k_all.shape[2], k_all.shape[-1]
    if fixed_batches(q.device):
        per_block = [k_all[:, :, b].reshape(-1, KEY_BLOCK, head_dim).transpose(1, 2) for b in range(n_blocks)]
        return torch.cat([torch.bmm(q, k) for k in per_block], dim=-1)
    return torch.bmm(q, k_all.view(-1, n_blocks * KEY_BLOCK, head_dim).transpose(1, 2))


def _weighted(e_blocks: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
    """Each block's weights ``e_blocks`` ``[items, kv, blocks, rows, KEY_BLOCK]`` times its values
    ``v_all`` ``[items, kv, blocks, KEY_BLOCK, d]``: one fixed-shape product per block, in one
    batch on the CPU, one batch per block on a GPU."""
    _, _, n_blocks, rows, _ = e_blocks.shape
    head_dim = v_all.shape[-1]
    if fixed_batches(e_blocks.device):
        per_block = [
            torch.bmm(e_blocks[:, :, b].reshape(-1, rows, KEY_BLOCK), v_all[:, :, b].reshape(-1, KEY_BLOCK, head_dim))
            for b in range(n_blocks)
        ]
        return torch.stack(per_block, dim=1)
    return torch.bmm(e_blocks.view(-1, rows, KEY_BLOCK), v_all.reshape(-1, KEY_BLOCK, head_dim))


def _blocks(store: torch.Tensor, seq: torch.Tensor, blocks: int, first_seq: int | None) -> torch.Tensor:
    """The first ``blocks`` key blocks of sequences ``seq``: ``[items, kv_heads, blocks, KEY_BLOCK,
    head_dim]`` float32 (positions past the store's end are zeros, and every position past a
    query's own is masked). Each ``[KEY_BLOCK, head_dim]`` matrix has contiguous rows whatever the
    store's strides (a matmul's kernel, and so its rounding, depends on them; the batch's stride
    does not, tested), so sequences ``first_seq ..`` in order are read as a view of a float32 store.
    Otherwise a gather by ``index_select``: the backward of ``store[seq]`` (``index_put_``
    accumulating) sums repeated rows in an order that varies with thread timing on the CPU;
    ``index_select``'s does not."""
    items, kv_heads, head_dim, width = seq.shape[0], store.shape[1], store.shape[3], blocks * KEY_BLOCK
    if first_seq is not None and store.dtype == torch.float32 and store.shape[2] >= width and store[0].is_contiguous():
        return store[first_seq : first_seq + items, :, :width].view(items, kv_heads, blocks, KEY_BLOCK, head_dim)
    part = store[:, :, :width].index_select(0, seq)
    short = width - part.shape[2]
    part = (F.pad(part, (0, 0, 0, short)) if short else part).float()
    return part.view(items, kv_heads, blocks, KEY_BLOCK, head_dim)
