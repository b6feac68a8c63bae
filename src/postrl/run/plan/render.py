"""The plan as the table ``postrl plan`` prints."""

from __future__ import annotations

from postrl.run.plan.planner import GB, Plan

ITEMS = ["weights", "gradients", "optimizer", "master_weights", "activations", "kv_cache", "workspace"]


def size(nbytes: float) -> str:
    """``17.50 GB``, ``412.3 MB`` (1e9 and 1e6 bytes, as GPU data sheets count)."""
    if nbytes >= GB:
        return f"{nbytes / GB:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB"


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def render_plan(plan: Plan) -> str:
    g = plan.target.gpu
    per = "per GPU" if plan.target.accelerator else "in all"
    lines = [
        f"postrl plan: {plan.model} ({count(plan.params)} parameters) on {g.name} "
        f"({g.memory_gb:.1f} GB, {plan.target.usable_bytes / GB:.1f} GB usable {per})",
        "",
        *memory_table(plan),
        "",
        *sizes_lines(plan),
        *split_lines(plan),
    ]
    if plan.problems:
        lines += ["", "DOES NOT FIT:"] + [f"  - {p.message()}" for p in plan.problems]
    else:
        lines += ["", "fits: every role fits its GPUs"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def memory_table(plan: Plan) -> list[str]:
    names = [r.role for r in plan.roles]
    width = max(14, *(len(n) + 2 for n in names))
    head = ("per GPU" if plan.target.accelerator else "on the CPU").ljust(18) + "".join(n.rjust(width) for n in names)
    ranks = "ranks".ljust(18) + "".join(
        (f"TP={r.ranks}" if r.role == "rollout engine" else f"FSDP={r.ranks}").rjust(width) for r in plan.roles
    )
    rows = [head, ranks]
    for item in ITEMS:
        if any(item in r.items for r in plan.roles):
            cells = [size(r.items[item]) if r.items.get(item) else "-" for r in plan.roles]
            rows.append(item.replace("_", " ").ljust(18) + "".join(c.rjust(width) for c in cells))
    rows.append("total".ljust(18) + "".join(size(r.total).rjust(width) for r in plan.roles))
    return rows


def sizes_lines(plan: Plan) -> list[str]:
    out = []
    train = plan.role("train rank")
    d = train.detail
    out.append(
        f"training: FSDP size {plan.train_fsdp or 'none fits'}; micro-batch of {d['micro_batch_tokens']} tokens: "
        f"activations {size(float(d['activations_without_checkpointing']))} without checkpointing, "
        f"{size(float(d['activations_with_checkpointing']))} with; {float(d['model_state_bytes_per_param']):.3g} "
        "bytes of model state per parameter"
    )
    if plan.rollout_max_concurrency is not None:
        r = plan.role("rollout engine").detail
        out.append(
            f"rollout: tensor-parallel size {plan.rollout_tp or 'none fits'}; KV cache for {r['concurrency']} "
            f"sequences x {r['max_len']} tokens ({size(float(r['kv_bytes_per_sequence']))} each); at most "
            f"{plan.rollout_max_concurrency} sequences fit"
        )
    return out


def split_lines(plan: Plan) -> list[str]:
    if not plan.target.accelerator:  # the rates a GPU estimate rests on say nothing of a CPU's step
        return ["time: no estimate on a CPU (its speed is not modelled: run a few steps and read time/step_s)"]
    s = plan.split
    eff = s["efficiency"]
    assumed = (
        f"at {eff['train_mfu']:.0%} of the bf16 rate for training, {eff['prefill_mfu']:.0%} for prefill, "
        f"{eff['decode_bandwidth']:.0%} of the bandwidth for decode"
    )
    if s.get("colocate"):
        return [
            f"split: {s['why']}",
            f"  one engine generates a step in ~{s['generate_s_one_engine']:.3g} s, "
            f"one GPU trains it in ~{s['train_s_one_gpu']:.3g} s ({assumed})",
        ]
    return [
        f"split of {s['gpus']} GPUs ({s['mode']} steps): {s['rollout_gpus']} for rollout ({s['rollout_engines']} "
        f"engine(s)), {s['train_gpus']} for training: ~{s['step_s']:.3g} s a step (generate {s['generate_s']:.3g} s, "
        f"train {s['train_s']:.3g} s; {assumed})"
    ]
