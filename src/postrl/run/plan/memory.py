"""The memory model: bytes per GPU of each role of a run, item by item.

Training (one rank of an FSDP group of ``fsdp`` ranks, postrl's update as it runs):
- weights: the parameters in ``model.dtype``; sharded over the FSDP ranks. With float32 parameters
  they are also the master copy the optimizer updates (no separate master weights); bf16 parameters
  are trained without one.
- gradients: one per trainable parameter, in the parameters' dtype; optimizer: AdamW's two moments,
  in the parameters' dtype. Model states: 4 + 4 + 8 = 16 bytes per float32 parameter (the same
  as the mixed-precision convention 2 + 2 + 4 + 8 with bf16 weights and gradients and fp32 masters).
- activations: what the lean forward keeps for the backward at one micro-batch (each group's prompt
  once, its responses after it), per decoder layer: the two norms' inputs and outputs, the
  attention's gathered queries, keys, values and probabilities per block, its output, the MLP's gate,
  up and product; with activation checkpointing, each layer's input and one layer recomputed.
- workspace: the backward's gradients of one layer's activations, the head's chunk of logits and
  its gradient, bf16 copies of the weights under autocast, gathered layers under FSDP.
Rollout (one engine rank of ``tp``): weights in the engine's dtype / tp, the KV cache preallocated for
``concurrency`` sequences of ``max_len`` tokens, and the decode step's logits and sampling buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from postrl.run.plan.shape import ModelShape

CHUNK_ROWS_ELEMENTS = 1 << 25  # postrl.train.chunked_head.CHUNK_ELEMENTS: one chunk of float32 logits


@dataclass
class RoleMemory:
    """Bytes per GPU of one role, by item; ``total`` is their sum."""

    role: str
    items: dict[str, int]
    ranks: int = 1  # tensor-parallel (rollout) or FSDP (training) size this figure is for
    detail: dict[str, float | int | str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclass(frozen=True)
class MicroBatch:
    """The shape of one forward/backward: ``groups`` prompts of ``prompt_tokens``, each followed by
    ``rows`` responses of ``response_tokens``."""

    groups: int
    rows: int
    prompt_tokens: int
    response_tokens: int

    @property
    def tokens(self) -> int:
        return self.groups * (self.prompt_tokens + self.rows * self.response_tokens)

    @property
    def response_positions(self) -> int:
        return self.groups * self.rows * self.response_tokens

    @property
    def blocks(self) -> int:
        return self.groups * (1 + self.rows)


def micro_batch(
    sequences: int, n: int, prompt_tokens: int, response_tokens: int, token_budget: int | None = None
) -> MicroBatch:
    """Whole groups of ``n`` per micro-batch of ``sequences`` (a group larger than that is cut into
    runs of rows, each with its prompt); with ``token_budget`` the groups that fit those tokens."""
    if token_budget is not None:
        group_tokens = prompt_tokens + n * response_tokens
        if group_tokens <= token_budget:
            return MicroBatch(token_budget // group_tokens, n, prompt_tokens, response_tokens)
        rows = max(1, (token_budget - prompt_tokens) // response_tokens)
        return MicroBatch(1, min(n, rows), prompt_tokens, response_tokens)
    if sequences >= n:
        return MicroBatch(sequences // n, n, prompt_tokens, response_tokens)
    return MicroBatch(1, sequences, prompt_tokens, response_tokens)


def layer_activation_bytes(shape: ModelShape, micro: MicroBatch, act_bytes: int) -> int:
    """What one decoder layer of the lean forward keeps for its backward."""
    s, t = shape, micro.tokens
    query_width = max(micro.prompt_tokens, micro.response_tokens)
    key_width = micro.prompt_tokens + micro.response_tokens
    per_token = 4 * s.hidden + s.q_width + 3 * s.intermediate  # norm in/out x2, attention output, gate/up/product
    per_block = s.heads * s.head_dim * (query_width + 2 * key_width) + s.heads * query_width * key_width
    norms = 2 * t * 4  # float32 1/rms per token, two norms
    return act_bytes * (t * per_token + micro.blocks * per_block) + norms


def transformers_layer_bytes(
    shape: ModelShape, micro: MicroBatch, act_bytes: int, residual_bytes: int, eager: bool
) -> int:
    """What one decoder layer of the transformers forward keeps (each group packed as one sequence of
    ``width`` tokens): the residual stream in the parameters' dtype and the norms' float32 products,
    the projections' inputs, queries and keys/values repeated to every head for attention, its
    output, the MLP's gate, up, activation and product; eager attention also its probabilities."""
    s, t = shape, micro.tokens
    norms = 2 * t * (residual_bytes * s.hidden + 4 * s.hidden + 4)
    per_token = 2 * s.hidden + 4 * s.q_width + 4 * s.intermediate
    width = micro.prompt_tokens + micro.rows * micro.response_tokens
    kept = 4 + (act_bytes if act_bytes < 4 else 0)  # the float32 softmax, and its half-precision cast
    probs = micro.groups * s.heads * width * width * kept if eager else 4 * s.heads * t
    return norms + act_bytes * t * per_token + probs


def layer_bytes(shape: ModelShape, micro: MicroBatch, setup: TrainSetup) -> int:
    if setup.lean:
        return layer_activation_bytes(shape, micro, setup.act_bytes)
    return transformers_layer_bytes(shape, micro, setup.act_bytes, setup.param_bytes, setup.eager_attention)


def activation_bytes(shape: ModelShape, setup: TrainSetup, checkpointing: bool) -> int:
    """Everything the forward keeps until the backward: the layers', the attention mask and the head's inputs."""
    micro, ab = setup.micro, setup.act_bytes
    t = micro.tokens
    if setup.lean:
        query_width = max(micro.prompt_tokens, micro.response_tokens)
        mask = micro.blocks * query_width * (micro.prompt_tokens + micro.response_tokens) * (4 + 1)
    else:
        width = micro.prompt_tokens + micro.rows * micro.response_tokens
        mask = micro.groups * width * width * (4 + 1)
    final = ab * t * shape.hidden + 4 * t + ab * micro.response_positions * shape.hidden
    head = 3 * 4 * micro.response_positions
    layer = layer_bytes(shape, micro, setup)
    residual = setup.act_bytes if setup.lean else setup.param_bytes
    layers = shape.layers * residual * t * shape.hidden if checkpointing else shape.layers * layer
    return layers + mask + final + head


def head_workspace_bytes(shape: ModelShape, micro: MicroBatch, act_bytes: int, head_trained: bool = True) -> int:
    """The head's backward: a chunk of logits and their gradient (float32), the hidden states'
    gradient, and (when the head is trained) its weight's float32 gradient with the chunk's part."""
    rows = min(micro.response_positions, max(1, CHUNK_ROWS_ELEMENTS // shape.vocab))
    weight_grad = 2 * 4 * shape.vocab * shape.hidden if head_trained else 0
    return 3 * 4 * rows * shape.vocab + act_bytes * micro.response_positions * shape.hidden + weight_grad


@dataclass(frozen=True)
class TrainSetup:
    """How a model is trained, as memory sees it."""

    param_bytes: int  # model.dtype
    act_bytes: int  # 2 under bf16 autocast or bf16 parameters, else 4
    autocast: bool
    micro: MicroBatch
    checkpointing: bool
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ()
    lean: bool = True  # postrl's lean forward (a Llama-family model, unsharded); else the transformers forward
    eager_attention: bool = True  # the transformers forward's attention: eager (probabilities kept) or SDPA


def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """A and B of every targeted projection: ``r * (in + out)`` each."""
    s = shape
    dims = {
        "q_proj": (s.hidden, s.q_width),
        "k_proj": (s.hidden, s.kv_width),
        "v_proj": (s.hidden, s.kv_width),
        "o_proj": (s.q_width, s.hidden),
        "gate_proj": (s.hidden, s.intermediate),
        "up_proj": (s.hidden, s.intermediate),
        "down_proj": (s.intermediate, s.hidden),
    }
    return s.layers * sum(rank * (i + o) for name, (i, o) in dims.items() if name in targets)


def backward_workspace_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The backward's widest moment beyond the kept activations: the head's (first), or a layer's
    gradients (with checkpointing, the layer recomputed as well)."""
    micro, s = setup.micro, shape
    head = head_workspace_bytes(shape, micro, setup.act_bytes, head_trained=setup.lora_rank is None)
    # a layer's backward: the softmax's gradient (three float32 temporaries the size of the kept
    # probabilities), or the MLP's (the gradients of gate, up and product, and of its input)
    if setup.lean:
        probs = (
            micro.blocks
            * s.heads
            * max(micro.prompt_tokens, micro.response_tokens)
            * (micro.prompt_tokens + micro.response_tokens)
        )
    else:
        width = micro.prompt_tokens + micro.rows * micro.response_tokens
        probs = micro.groups * s.heads * width * width if setup.eager_attention else 0
    backward = max(3 * 4 * probs, setup.act_bytes * micro.tokens * (3 * s.intermediate + 2 * s.hidden))
    recomputed = layer_bytes(shape, micro, setup) if setup.checkpointing else 0
    return max(head, recomputed + backward)


def stacked_lora_bases(shape: ModelShape, setup: TrainSetup) -> int:
    """The lean forward runs LoRA projections that read the same input as one product: the frozen
    q|k|v and gate|up weights are stacked per layer, and kept for the backward."""
    if setup.lora_rank is None or not setup.lean:
        return 0
    s, targets = shape, set(setup.lora_targets)
    rows = (s.q_width + 2 * s.kv_width if {"q_proj", "k_proj", "v_proj"} <= targets else 0) + (
        2 * s.intermediate if {"gate_proj", "up_proj"} <= targets else 0
    )
    return s.layers * rows * s.hidden * setup.param_bytes


def train_rank_memory(shape: ModelShape, setup: TrainSetup, fsdp: int = 1, role: str = "train rank") -> RoleMemory:
    """One rank of the policy's FSDP group of ``fsdp`` (1: a plain process)."""
    if fsdp > 1 and setup.lean:  # FSDP2 gathers parameters in the model's own forward
        setup = replace(setup, lean=False)
    pb, ab = setup.param_bytes, setup.act_bytes
    if setup.lora_rank is not None:
        trainable, state_bytes = lora_params(shape, setup.lora_rank, setup.lora_targets), 4  # adapters in float32
    else:
        trainable, state_bytes = shape.params, pb
    gathered = 2 * shape.layer_linear_params * ab if fsdp > 1 else 0  # the layer computing and the one prefetched
    casts = (
        2 * shape.linear_params if setup.autocast and pb == 4 and fsdp == 1 else 0
    )  # FSDP2 gathers bf16 layers instead
    stacked = stacked_lora_bases(shape, setup) if fsdp == 1 else 0
    items = {
        "weights": shape.params * pb // fsdp + (trainable * 4 // fsdp if setup.lora_rank else 0),
        "gradients": trainable * state_bytes // fsdp,
        "optimizer": 2 * trainable * state_bytes // fsdp,
        "master_weights": 0,
        "activations": activation_bytes(shape, setup, setup.checkpointing),
        "workspace": backward_workspace_bytes(shape, setup) + gathered + casts + stacked,
    }
    detail: dict[str, float | int | str] = {
        "trainable_params": trainable,
        "micro_batch_tokens": setup.micro.tokens,
        "activations_without_checkpointing": activation_bytes(shape, setup, False),
        "activations_with_checkpointing": activation_bytes(shape, setup, True),
        "forward": "lean" if setup.lean else "transformers",
        "model_state_bytes_per_param": (items["weights"] + items["gradients"] + items["optimizer"])
        * fsdp
        / shape.params,
    }
    return RoleMemory(role, items, fsdp, detail)


def frozen_model_memory(
    shape: ModelShape, param_bytes: int, micro: MicroBatch, act_bytes: int, role: str, ranks: int = 1
) -> RoleMemory:
    """A model that only runs forward (the reference, a reward model): weights and one layer's work."""
    items = {
        "weights": shape.params * param_bytes // ranks,
        "workspace": layer_activation_bytes(shape, micro, act_bytes)
        + head_workspace_bytes(shape, micro, act_bytes, False),
    }
    return RoleMemory(role, items, ranks)


@dataclass(frozen=True)
class RolloutSetup:
    dtype_bytes: int
    concurrency: int  # sequences decoded together
    max_len: int  # prompt + response tokens a sequence may reach
    prefill_tokens: int  # tokens prefilled in one pass
    prompt_tokens: int  # the longest prompt
    transposed_head: bool = True  # the native engine keeps the head as [hidden, vocab] for decode's matmul


def rollout_memory(shape: ModelShape, setup: RolloutSetup, tp: int = 1) -> RoleMemory:
    """One rank of a rollout engine with tensor-parallel size ``tp``."""
    db = setup.dtype_bytes
    kv = setup.concurrency * setup.max_len * shape.kv_bytes_per_token(db, tp)
    s = shape
    # a prefill pass's widest moment: the fused q|k|v and gate|up outputs, the rotary embedding's
    # five temporaries of q and k, the residual stream, and each prompt's attention scores
    per_token = (
        3 * s.hidden + (2 * s.q_width + 4 * s.kv_width + 2 * s.intermediate + 5 * (s.q_width + s.kv_width)) // tp
    )
    scores = 2 * 4 * (s.heads // tp or 1) * min(setup.prompt_tokens, setup.prefill_tokens)
    prefill = setup.prefill_tokens * (db * per_token + scores)
    decode = setup.concurrency * shape.vocab * 4 * 3  # logits, probabilities and their log, float32
    head_t = shape.vocab * shape.hidden * db // tp if setup.transposed_head else 0
    items = {"weights": shape.params * db // tp, "kv_cache": kv, "workspace": head_t + max(prefill, decode)}
    detail: dict[str, float | int | str] = {
        "kv_bytes_per_sequence": setup.max_len * shape.kv_bytes_per_token(db, tp),
        "concurrency": setup.concurrency,
        "max_len": setup.max_len,
    }
    return RoleMemory("rollout engine", items, tp, detail)
