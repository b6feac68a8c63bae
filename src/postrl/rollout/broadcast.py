"""Weight sync over a torch.distributed broadcast group: the sender (rank 0) and N engines.

The state is cut into buckets of about ``bucket_bytes``; each bucket is packed into one byte
buffer and broadcast, so the sender never holds more than one bucket beyond the model itself. An
engine stages what arrives and swaps it in only after the whole state arrived and matched the
checksum manifest: until then it keeps serving the old version. The group is a standalone gloo
group on its own TCP store (no global process group), made for one sync; an engine that dies
breaks the transfer for the others at once (gloo reports the closed connection), and every
collective has a timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BroadcastPlan:
    """What will be sent, bucket by bucket: every engine rebuilds the tensors from it."""

    buckets: tuple[tuple[TensorSpec, ...], ...]
    sizes: tuple[int, ...]


def plan_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> BroadcastPlan:
    buckets: list[tuple[TensorSpec, ...]] = []
    sizes: list[int] = []
    current: list[TensorSpec] = []
    used = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and used + nbytes > bucket_bytes:
            buckets.append(tuple(current))
            sizes.append(used)
            current, used = [], 0
        current.append(TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), used, nbytes))
        used += nbytes
    if current:
        buckets.append(tuple(current))
        sizes.append(used)
    return BroadcastPlan(tuple(buckets), tuple(sizes))


def pack(state: dict[str, torch.Tensor], specs: tuple[TensorSpec, ...], size: int) -> torch.Tensor:
    buffer = torch.empty(size, dtype=torch.uint8)
    for spec in specs:
        flat = state[spec.name].detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        buffer[spec.offset : spec.offset + spec.nbytes] = flat
    return buffer


def unpack(buffer: torch.Tensor, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for spec in specs:
        raw = buffer[spec.offset : spec.offset + spec.nbytes].clone()
        out[spec.name] = raw.view(DTYPES[spec.dtype]).reshape(spec.shape)
    return out


def _group(
    host: str, port: int, rank: int, world: int, timeout_s: float, store: dist.TCPStore | None = None
) -> tuple[dist.TCPStore, dist.ProcessGroup]:
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout, wait_for_workers=False)
    return store, dist.ProcessGroupGloo(store, rank, world, timeout)


def open_sender_store(host: str, port: int, world: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous the engines join; made before they are asked to, so they find it."""
    return dist.TCPStore(host, port, world, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def send_state(
    store: dist.TCPStore, state: dict[str, torch.Tensor], plan: BroadcastPlan, world: int, timeout_s: float
) -> None:
    """Broadcast every bucket from rank 0."""
    _, group = _group("", 0, 0, world, timeout_s, store)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    try:
        for specs, size in zip(plan.buckets, plan.sizes):
            buffer = pack(state, specs, size)
            group.broadcast([buffer], options).wait()
    finally:
        del group  # closes the connections: receivers of a broken transfer fail at once instead of waiting


def receive_state(
    host: str, port: int, rank: int, world: int, plan: BroadcastPlan, timeout_s: float
) -> dict[str, torch.Tensor]:
    """Join the sender's group and receive the whole state (staged on the CPU)."""
    store, group = _group(host, port, rank, world, timeout_s)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    state: dict[str, torch.Tensor] = {}
    try:
        for specs, size in zip(plan.buckets, plan.sizes):
            buffer = torch.empty(size, dtype=torch.uint8)
            group.broadcast([buffer], options).wait()
            state.update(unpack(buffer, specs))
    finally:
        del group, store
    return state
