"""The vLLM server's hold on its running engine (:mod:`postrl.rollout.vllm_server`): new weights
or a LoRA adapter loaded in place, swapped in between two engine steps of a generation in progress.

Loaded by path by the server in vLLM's environment, where postrl is not installed: it imports only
the standard library (vLLM inside the functions that need it).
"""

from __future__ import annotations

import threading
from typing import Any


def _reload(llm: Any, path: str) -> bool:
    """Reload one safetensors file into the running engine, in place; True when the prefix cache
    was reset too (it cannot be while requests run: then the caller resets it before the next batch).

    vLLM's worker ``reload_weights`` takes a model folder (``weights_path``); the file is linked
    into a fresh folder of its own so nothing else next to it is picked up. Only strings cross
    vLLM's process boundary (callables would need its insecure pickle fallback)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="postrl-reload-") as folder:
        os.symlink(os.path.abspath(path), os.path.join(folder, "model.safetensors"))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": folder, "is_checkpoint_format": True})
    llm.apply_model(_repack_tied_head)
    return bool(llm.reset_prefix_cache())


def _repack_tied_head(model: Any) -> bool:
    """Pack a tied head again from the reloaded embedding; True when the model has one.

    vLLM's CPU backend prepacks the head's weight for its matmul when the model loads. With tied
    embeddings (SmolLM2, the demo model) a reload loads ``embed_tokens`` only (the checkpoint has no
    ``lm_head``), so the head is never processed again and would go on with the old weights:
    measured, sampled logprobs 1.2 off the synced model's after one sync. Runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so nothing is pickled."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank sizes
POLICY_ADAPTER_ID = 1  # the one adapter slot: every version of the policy's adapter takes it


def _load_adapter(llm: Any, folder: str) -> tuple[Any, bool]:
    """Make ``folder`` (a peft adapter) the policy's adapter, in place of the one loaded before;
    returns its request for new generations and whether the prefix cache was reset (cached blocks
    were computed with the previous adapter under the same id)."""
    from vllm.lora.request import LoRARequest

    request = LoRARequest("policy", POLICY_ADAPTER_ID, folder)
    engine = llm.llm_engine
    if POLICY_ADAPTER_ID in engine.list_loras():
        engine.remove_lora(POLICY_ADAPTER_ID)
    if not engine.add_lora(request):
        raise RuntimeError(f"vLLM did not load the adapter in {folder}")
    return request, bool(llm.reset_prefix_cache())


class EngineControl:
    """What a generation in progress and the other endpoints share: the weight version, weights
    posted meanwhile (swapped in between two steps), a suspend request. ``cv`` guards all of it;
    the engine itself belongs to whoever holds ``engine_lock``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.version = 0
        self.engine_lock = threading.Lock()
        self.cv = threading.Condition()
        self.generating = self.suspending = False
        self.steps = 0  # engine steps of the batch generating now (or the last one)
        self.pending: dict | None = None  # {path, adapter, version, done, error}
        self.prefix_stale = False  # weights changed while requests ran: reset the prefix cache before the next batch
        self.adapter: Any = None  # the policy's LoRARequest, given to every new request (None: the base weights)

    def apply(self, path: str, version: int, adapter: bool = False) -> None:
        """Load the weights, or with ``adapter`` the adapter folder (the caller holds the engine)."""
        if adapter:
            self.adapter, reset = _load_adapter(self.llm, path)
        else:
            reset = _reload(self.llm, path)
        if not reset:
            self.prefix_stale = True
        with self.cv:
            self.version = version

    def update(self, path: str, version: int, adapter: bool = False) -> Exception | None:
        """New weights (or an adapter folder): swapped in between two steps of the batch generating
        now (this returns once they are), or at once; the error of a file that does not load, else None."""
        with self.cv:
            self.cv.wait_for(lambda: self.pending is None)  # one posted update at a time
            if self.generating:
                pending = self.pending = {
                    "path": path,
                    "adapter": adapter,
                    "version": version,
                    "done": False,
                    "error": None,
                }
                self.cv.wait_for(lambda: pending["done"])
                return pending["error"]
        with self.engine_lock:
            try:
                self.apply(path, version, adapter)
            except Exception as exc:  # noqa: BLE001 - a bad file is the client's error
                return exc
        return None

    def apply_pending(self) -> None:
        """Between two steps of a generation (or after it): swap in weights posted meanwhile."""
        with self.cv:
            pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            self.apply(pending["path"], pending["version"], pending["adapter"])
        except Exception as exc:  # noqa: BLE001 - handed to the caller of /update_weights
            pending["error"] = exc
        with self.cv:
            pending["done"] = True
            self.cv.notify_all()
