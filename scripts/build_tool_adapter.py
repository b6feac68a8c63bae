"""Build the shipped tool-calling warm start of SmolLM2-135M-Instruct: assets/tool_adapter/.

    .venv/bin/python scripts/build_tool_adapter.py            # ~6-8 min on 2 cores

1. writes tool-calling traces (postrl.data.tool_traces: integer arithmetic, one Hermes <tool_call>
   per operation, the tools described as the Agents SDK, LangChain and postrl write them);
2. runs ``postrl sft`` on them with a LoRA adapter (r 8 on every linear layer, bf16 autocast);
3. checks it: on held-out traces (another seed), greedy, the share of first turns that are a
   well-formed call of an offered tool, and the share of whole episodes solved with the tools;
4. writes the adapter (its weights in bf16, ~5 MB) and build_info.json (the settings, the minutes
   and the check) into the package.

Then ``postrl merge-lora smollm2-tools models/smollm2-tools`` writes the merged model. The same seed
gives the same traces and the same order; the weights match to the last bits only on the same CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from postrl.config.loading import build_config
from postrl.config.sft import SFTRunConfig
from postrl.data.tool_traces import TOOLS, trace, write_traces
from postrl.models.merge_adapter import TOOL_ADAPTER_DIR
from postrl.run.sft_runner import train_sft

SFT = {
    "lora": {"r": 8, "alpha": 16, "export": "adapter"},
    "train": {"lr": 1.0e-3, "mini_batch_size": 8, "micro_batch_size": 8, "precision": "bf16_autocast"},
}


def check(model_dir: Path, adapter: Path, problems: int, seed: int) -> dict:
    """Greedy episodes on held-out traces' problems (the native engine, every episode's turn in one
    batch), the tools answered by the traces' own arithmetic."""
    from peft import PeftModel

    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.serve.tool_formats import Hermes
    from postrl.types import Prompt, SamplingParams

    tokenizer = load_tokenizer(str(model_dir))
    model = PeftModel.from_pretrained(load_causal_lm(str(model_dir)), str(adapter)).merge_and_unload()
    engine = NativeRolloutWorker.from_hf(model, tokenizer, torch.float32, seed=seed)
    rng = random.Random(seed)
    rows = [trace(rng) for _ in range(problems)]
    live = {i: row["messages"][:2] for i, row in enumerate(rows)}
    first_calls, solved, calls = 0, 0, 0
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=64)
    for turn in range(6):
        if not live:
            break
        texts = {
            i: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for i, m in live.items()
        }
        prompts = [Prompt(t, tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts.values()]
        for i, out in zip(list(live), engine.generate(prompts, greedy, None), strict=True):
            text = tokenizer.decode(out.response_ids, skip_special_tokens=True)
            offered = {name for name in TOOLS if f'"name": "{name}"' in live[i][0]["content"]}
            parsed = Hermes().parse(text, offered)
            if parsed is None:
                numbers = re.findall(r"-?\d+", text)
                solved += bool(numbers) and numbers[-1] == rows[i]["answer"]
                del live[i]
                continue
            first_calls += turn == 0
            call = parsed.calls[0]
            args, tool = json.loads(call.arguments), TOOLS[call.name]
            (a, _), (b, _) = tool.arguments
            try:
                result = str(tool.apply(int(args[a]), int(args[b])))
            except (KeyError, TypeError, ValueError):
                result = "error: the tool takes two integers"
            calls += 1
            live[i] = [*live[i], {"role": "assistant", "content": text}, {"role": "tool", "content": result}]
    engine.close()
    return {
        "problems": problems,
        "first_turn_calls": first_calls / problems,
        "solved": solved / problems,
        "calls_per_episode": calls / problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="SmolLM2-135M-Instruct's folder (default: the converted cache)")
    parser.add_argument("--examples", type=int, default=200, help="traces to train on (one epoch)")
    parser.add_argument("--check", type=int, default=40, help="held-out problems to check the adapter on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=TOOL_ADAPTER_DIR)
    args = parser.parse_args()
    if args.base is None:
        from postrl.models.gguf import smollm2_dir

        args.base = str(smollm2_dir())
    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="postrl-tool-adapter-"))
    traces = write_traces(work / "traces.jsonl", args.examples, seed=args.seed)
    config = build_config(
        {
            "name": "tool-adapter",
            "output_dir": str(work / "runs"),
            "seed": args.seed,
            "model": {"path": args.base, "lora": SFT["lora"]},
            "data": {"train_files": [str(traces)], "max_tokens": 1024},
            "train": SFT["train"],
        },
        model=SFTRunConfig,
    )
    train_sft(config)
    minutes = (time.perf_counter() - began) / 60
    adapter = work / "runs" / "tool-adapter" / "final_model"
    result = check(Path(args.base), adapter, args.check, seed=args.seed + 1)
    args.out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(adapter / "adapter_model.safetensors").items()}
    save_file(weights, args.out / "adapter_model.safetensors")
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    (args.out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    info = {"examples": args.examples, "seed": args.seed, **SFT, "build_minutes": round(minutes, 2), "check": result}
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(info), file=sys.stderr)
    print(f"wrote {args.out} in {minutes:.1f} min: {result}")


if __name__ == "__main__":
    main()
