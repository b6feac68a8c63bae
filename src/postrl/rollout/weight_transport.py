"""How new weights reach the engines of a pool, one transport per value of ``rollout.weight_sync``:
``memory`` (:class:`DirectTransport`: each engine is handed the state dict; in-process, a child
process or an actor), ``safetensors`` (:class:`FileTransport`: one file in ``rollout.sync_dir``
that each engine loads) or ``broadcast`` (:class:`BroadcastTransport`: one torch.distributed group,
bucket by bucket; see :mod:`postrl.rollout.broadcast`).

``push`` answers which engines did not take the version because they were lost (died, timed out,
or their transfer broke when another engine died); an engine that received weights that do not
match the manifest refuses them, which is an error, not a loss."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from postrl.models.weights import WeightSyncError, write_sync_file
from postrl.rollout.broadcast import open_sender_store, plan_buckets, send_state
from postrl.workers import Handle, WorkerDiedError, WorkerTimeoutError
from postrl.workers.handles import submit
from postrl.workers.net import free_port


class WeightTransport(Protocol):
    def push(
        self, engines: list[Handle], weights: Any, version: int, manifest: dict[str, str] | None
    ) -> dict[str, str]: ...


def _outcomes(engines: list[Handle], futures: list[Future], version: int) -> dict[str, str]:
    """The engines lost during the push (name -> why); raise when any engine refused the weights
    (a :class:`WeightSyncError`, wherever the engine lives: the refusing engines keep their weights)."""
    lost: dict[str, str] = {}
    refused: list[str] = []
    for handle, future in zip(engines, futures):
        try:
            future.result()
        except WeightSyncError as exc:
            refused.append(f"{handle.name}: {str(exc).splitlines()[-1]}")
        except (WorkerDiedError, WorkerTimeoutError) as exc:
            lost[handle.name] = str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken transfer: the engine is replaced
            text = f"{type(exc).__name__}: {exc}"
            lost[handle.name] = text.splitlines()[-1] if text.strip() else type(exc).__name__
    if refused:
        raise WeightSyncError(
            f"weight version {version} was refused by {len(refused)} engine(s), which keep "
            f"their previous weights: {'; '.join(refused)}"
        )
    return lost


class DirectTransport:
    def __init__(self, timeout_s: float | None = 600.0) -> None:
        self.timeout_s = timeout_s

    def push(
        self, engines: list[Handle], weights: Any, version: int, manifest: dict[str, str] | None
    ) -> dict[str, str]:
        futures = [h.call_async("update_weights", weights, version, manifest, timeout=self.timeout_s) for h in engines]
        return _outcomes(engines, futures, version)


class FileTransport:
    """Writes each version once as ``policy.safetensors`` in a folder of its own under ``sync_dir``
    (None: the system's temporary folder; on a cluster, storage every engine reads) and hands the
    engines its path. The folder goes when the transport does."""

    def __init__(self, sync_dir: str | None = None, timeout_s: float | None = 600.0) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="postrl-sync-", dir=sync_dir))
        self._remove = weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.direct = DirectTransport(timeout_s)
        self._written: tuple[int, int] | None = None  # (id of the state, version) last written

    def push(
        self, engines: list[Handle], weights: Any, version: int, manifest: dict[str, str] | None
    ) -> dict[str, str]:
        path = self.folder / "policy.safetensors"
        if self._written != (id(weights), version):  # an engine replaced mid-sync reads the same file
            write_sync_file(weights, path)
            self._written = (id(weights), version)
        return self.direct.push(engines, path, version, manifest)


class BroadcastTransport:
    """Rank 0 is this process; engine ``i`` of the push is rank ``i + 1``."""

    def __init__(self, host: str = "127.0.0.1", bucket_bytes: int = 64 << 20, timeout_s: float = 120.0) -> None:
        self.host = host
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s

    def push(
        self, engines: list[Handle], weights: Any, version: int, manifest: dict[str, str] | None
    ) -> dict[str, str]:
        if not isinstance(weights, dict):
            raise TypeError("the broadcast transport sends a state dict, not a file path")
        alive = [h for h in engines if h.alive()]
        lost = {h.name: "not running" for h in engines if h not in alive}
        if not alive:
            return lost
        world = len(alive) + 1
        plan = plan_buckets(weights, self.bucket_bytes)
        port = free_port(self.host)
        store = open_sender_store(self.host, port, world, self.timeout_s)
        futures = [
            h.call_async(
                "receive_broadcast",
                self.host,
                port,
                rank,
                world,
                plan,
                version,
                manifest,
                self.timeout_s,
                timeout=self.timeout_s * 2,
            )
            for rank, h in enumerate(alive, start=1)
        ]
        sending = submit(send_state, store, weights, plan, world, self.timeout_s)
        try:
            lost.update(_outcomes(alive, futures, version))
        finally:
            failed_send = sending.exception()  # waits for the sender; its connections are closed by then
            del store
        if failed_send is not None and all(h.alive() for h in alive):  # no engine died: the sender itself failed
            raise failed_send
        return lost
