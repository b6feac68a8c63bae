"""Run inside .venv-vllm: vLLM's offline generate on given prompt token ids, kept up between runs.

Started by benchmarks/rollout_throughput.py as
``.venv-vllm/bin/python benchmarks/vllm_generate.py MODEL_DIR REQUEST.json``: it loads the model,
warms it up and prints ``{"ready": true}``; then each ``run`` line on stdin times one generate of
the request's prompts and prints ``{"tokens": ..., "seconds": ...}``; ``quit`` (or end of input)
exits. One process serves every timed run, so that the caller interleaves them with the other
engines' and a slow phase of the shared machine hits all of them.
"""

import json
import sys
import time


def main() -> None:
    if "--smoke" in sys.argv:  # a helper, not a benchmark: rollout_throughput.py --smoke starts it where vLLM is
        import importlib.util

        why = "vLLM is not installed here" if importlib.util.find_spec("vllm") is None else "it is a helper"
        print(f"skipped: {why}; rollout_throughput.py runs this script inside .venv-vllm (scripts/setup_vllm.sh)")
        if "--json" in sys.argv:
            print(json.dumps({"skipped": why}))
        return
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, request_file = sys.argv[1], sys.argv[2]
    req = json.load(open(request_file))
    llm = LLM(
        model=model_dir,
        dtype=req.get("dtype", "bfloat16"),
        max_model_len=req["max_model_len"],
        seed=0,
        enforce_eager=False,
        gpu_memory_utilization=req.get("memory_fraction", 0.25),
    )
    params = SamplingParams(
        n=req["n"],
        temperature=req["temperature"],
        top_p=1.0,
        top_k=-1,
        max_tokens=req["max_tokens"],
        logprobs=0,
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompt_ids"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        print(json.dumps({"tokens": tokens, "seconds": elapsed}), flush=True)


if __name__ == "__main__":
    main()
