"""``rollout.backend: vllm``: a Rollout Worker that drives a vLLM server (server-based rollout).

postrl starts :mod:`postrl.rollout.vllm_server` in the vLLM virtual environment (vLLM pins its
own torch and transformers, so it cannot live in postrl's), waits for ``/health``, sends each
``generate`` as one token-id batch and syncs weights through a safetensors file that the server
reloads in place, between two engine steps when a batch is generating (each token comes back
with the version that produced it); ``suspend`` stops the batch in progress. The server's
logprobs are the behaviour policy's. With ``max_lora_rank`` (a LoRA run's adapter sync) the server
runs vLLM's LoRA layers, and a sync of adapters reaches it as a peft adapter folder that it
applies unmerged, ``x W + s (x A) B``, as the trainer computes.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from postrl.models.adapters import adapter_modules, is_adapter_state, write_peft_adapter
from postrl.models.weights import safetensors_keys, write_sync_file
from postrl.rollout.common import EngineBase, completions_body, http_health
from postrl.types import Health, Prompt, Rollout, SamplingParams
from postrl.workers.net import free_port

SERVER_FILE = Path(__file__).with_name("vllm_server.py")
DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def vllm_python() -> Path | None:
    """The vLLM environment's interpreter: $POSTRL_VLLM_PYTHON, else the repo's .venv-vllm."""
    path = Path(os.environ.get("POSTRL_VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    return path if path.is_file() else None


def server_command(
    python: Path, model_dir: str | Path, port: int, dtype: str, max_model_len: int, seed: int, memory_fraction: float
) -> list[str]:
    """The command line of postrl's vLLM server process (``rollout/vllm_server.py``), its token read
    from ``POSTRL_VLLM_TOKEN``."""
    return [
        str(python),
        str(SERVER_FILE),
        *("--model", str(model_dir), "--port", str(port), "--dtype", dtype),
        *("--max-model-len", str(max_model_len), "--seed", str(seed), "--token-env", "POSTRL_VLLM_TOKEN"),
        *("--memory-fraction", str(memory_fraction)),
    ]


class VLLMRolloutWorker(EngineBase):
    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: Any,
        *,
        max_model_len: int = 2048,
        dtype: str = "bfloat16",
        seed: int = 0,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 3600.0,
        memory_fraction: float = 0.25,
        max_lora_rank: int | None = None,
    ) -> None:
        python = vllm_python()
        if python is None:
            raise FileNotFoundError("no vLLM environment: run scripts/setup_vllm.sh or set POSTRL_VLLM_PYTHON")
        self.tokenizer = tokenizer
        self.weight_version = 0
        self.seed = seed
        self.max_lora_rank = max_lora_rank
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="postrl-vllm-", suffix=".log", delete=False)
        self.sync_dir = Path(tempfile.mkdtemp(prefix="postrl-vllm-sync-"))
        token = secrets.token_urlsafe(32)  # only this process may drive the server, /update_weights included
        command = server_command(python, model_dir, self.port, dtype, max_model_len, seed, memory_fraction)
        command += ["--weights-dir", str(self.sync_dir), "--max-lora-rank", str(max_lora_rank or 0)]
        self.proc = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "POSTRL_VLLM_TOKEN": token},
        )
        headers = {"authorization": f"Bearer {token}"}
        self.client = httpx.Client(timeout=request_timeout_s, headers=headers)
        # weights, suspend and health go on a client of their own: they are sent while a generate waits
        self.control = httpx.Client(timeout=request_timeout_s, headers=headers)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {self.proc.returncode}; log: {self.log.name}\n{self._log_tail()}"
                )
            try:
                if self.client.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise TimeoutError(f"vLLM server not ready after {timeout_s:.0f}s; log: {self.log.name}")

    def _log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def generate(
        self, prompts: list[Prompt], sampling_params: SamplingParams, weight_version: int | None
    ) -> list[Rollout]:
        self.check_version(weight_version)
        sp = sampling_params
        body = {**completions_body(prompts, sp), "seed": sp.seed}
        response = self.client.post(self.url + "/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server {self.url} answered {response.status_code}: {response.text[:500]}")
        out = []
        for c in response.json()["choices"]:
            i = c["prompt_index"]
            out.append(
                Rollout(
                    prompt_index=i,
                    prompt_ids=list(prompts[i].prompt_ids),
                    response_ids=c["token_ids"],
                    logprobs=c["logprobs"]["token_logprobs"],
                    text=c["text"],
                    finish_reason=c["finish_reason"],
                    weight_version=c["weight_version"],
                    logprob_versions=c["logprob_versions"],
                    kv_versions=c["kv_versions"],
                )
            )
        return out

    def suspend(self) -> bool:
        """The server aborts the batch generating now between two engine steps; the generate
        waiting for it returns those samples ``suspended`` with their tokens so far."""
        response = self.control.post(self.url + "/suspend")
        if response.status_code != 200:
            raise RuntimeError(
                f"vLLM server {self.url} answered {response.status_code} to /suspend: {response.text[:300]}"
            )
        return bool(response.json()["suspended"])

    def update_weights(
        self, weights: dict[str, torch.Tensor] | str | Path, version: int, manifest: dict[str, str] | None = None
    ) -> None:
        if isinstance(weights, (str, Path)) and not is_adapter_state(safetensors_keys(Path(weights))):
            path = self._into_sync_dir(Path(weights))
            if manifest is not None:
                self.verified_state(path, manifest)
            body: dict[str, Any] = {"path": str(path)}
        else:
            state = self.verified_state(weights, manifest)
            if is_adapter_state(state):
                body = {"adapter": str(self._adapter_folder(state, version))}
            else:
                body = {"path": str(write_sync_file(state, self.sync_dir / "policy.safetensors"))}
        response = self.control.post(self.url + "/update_weights", json={**body, "version": version})
        if response.status_code != 200:
            raise RuntimeError(f"vLLM weight update failed ({response.status_code}): {response.text[:500]}")
        self.weight_version = version

    def _adapter_folder(self, state: dict[str, torch.Tensor], version: int) -> Path:
        """The adapters as a peft folder of this version's in the server's folder; older versions'
        folders are removed (the server has loaded the adapter it is using)."""
        if not self.max_lora_rank:
            raise RuntimeError(
                "a LoRA adapter sync reached a vLLM server started without LoRA (VLLMRolloutWorker max_lora_rank)"
            )
        ranks = {name: a.shape[0] for name, (a, _, _) in adapter_modules(state).items()}
        over = {name: r for name, r in ranks.items() if r > self.max_lora_rank}
        if over:
            raise RuntimeError(f"adapters of rank over the server's {self.max_lora_rank}: {over}")
        for old in self.sync_dir.glob("adapter-v*"):
            shutil.rmtree(old, ignore_errors=True)
        return write_peft_adapter(state, self.sync_dir / f"adapter-v{version}")

    def _into_sync_dir(self, path: Path) -> Path:
        """The server reads weights only from its own folder: hard-link (else copy) the file there."""
        target = self.sync_dir / "policy.safetensors"
        if path.resolve() == target.resolve():
            return target
        target.unlink(missing_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copyfile(path, target)
        return target

    def health(self) -> Health:
        """Asks the server; a dead process or a failed /health is unhealthy, with the log's tail."""
        if self.proc.poll() is not None:
            return Health(False, f"vLLM server exited with code {self.proc.returncode}; log {self.log.name}")
        return http_health(self.control, self.url, "vLLM server", timeout=5)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.client.close()
        self.control.close()

    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.close()
