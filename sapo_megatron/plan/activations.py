"""Activation memory of one training micro-batch on one rank: the tensors autograd keeps from the forward until
the backward, counted block by block for the Qwen3 layers Megatron builds, under TP/SP/CP/EP/ETP sharding,
pipeline in-flight micro-batches and activation recomputation.

Two layer specs (``spec``): ``te`` (Transformer Engine: fused norm+linear, flash/cuDNN attention that keeps
only q, k, v, the output and the softmax statistics, grouped expert GEMMs) is what GPU clusters run; ``local``
(Megatron's pure-torch spec: torch RMSNorm computing in fp32, unfused attention that keeps the s×s softmax,
sequential experts) is what runs here, and what ``bench/bench_planner.py`` and the tests measure.

Per token and layer, with ``d`` bytes per activation (2 for bf16/fp8, 4 for fp32), ``h`` hidden size, ``nq`` /
``nkv`` query / KV heads of ``hd`` channels, ``F`` / ``Fe`` dense / expert FFN width, ``k`` experts per token,
``E`` experts, ``t`` tensor parallel, ``Tt = T/t`` tokens of the sequence-parallel tensors (``T`` without SP):
see :func:`layer_blocks` for the terms. What is not counted: allocator fragmentation, communication buffers,
FP8 keeping some GEMM inputs in 1 byte instead of 2 (the estimate is then an upper bound), MoE routing
imbalance (every expert is assumed to receive ``T·k/E`` tokens), the loss hook's per-token inputs.

The vision tower of a vision-language model (first stage, for an image budget of ``P`` ViT patches per
micro-batch, :func:`vision_bytes`): per patch and ViT block of width ``hv`` and MLP width ``Iv``, what a pre-norm
block keeps for its backward with flash-style attention – the two norm inputs and outputs, q, k, v, the
attention output (``10·hv``) and the MLP's two ``Iv``-wide tensors – plus the mergers' inputs; nothing when
``model.freeze_vision`` (the tower runs without autograd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sapo_megatron.config import RunConfig, data_parallel_size, sequence_length_multiple
from sapo_megatron.model.precision import round_up

Spec = Literal["te", "local"]
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}


@dataclass(frozen=True)
class MicroBatchShape:
    """The tensor one micro-batch feeds the model: ``sequences`` rows of ``seq_len`` tokens (with packing, one
    row holding the token budget)."""

    sequences: int
    seq_len: int
    packed: bool = False

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len


def planned_prompt_tokens(cfg: RunConfig, prompt_tokens: int) -> int:
    """The prompt length the plan pads to: ``prompt_tokens`` (``--prompt-tokens``, default 512), but no more than
    the model's context leaves beside ``rollout.max_new_tokens`` (a tiny model of context 64 has no 512-token
    prompts)."""
    room = cfg.model.arch.max_position_embeddings - cfg.rollout.max_new_tokens
    return max(1, min(prompt_tokens, room))


def micro_batch_shape(cfg: RunConfig, world_size: int, prompt_tokens: int) -> MicroBatchShape:
    """The largest micro-batch of an RL update: ``parallel.max_tokens_per_micro_batch`` tokens when packing is on,
    else this rank's sequences per micro-batch, each padded to prompt + ``rollout.max_new_tokens`` (a response
    that runs to the limit pads the whole micro-batch to it; multi-turn episodes: ``max_context_tokens``), rounded up to :func:`sequence_length_multiple`."""
    multiple = sequence_length_multiple(cfg)
    budget = cfg.parallel.max_tokens_per_micro_batch
    if budget:
        return MicroBatchShape(1, round_up(budget, multiple), packed=True)
    per_update = cfg.rollout.n_samples * cfg.trainer.prompts_per_step // cfg.trainer.mini_batches
    split = data_parallel_size(cfg, world_size) * cfg.parallel.micro_batches
    sequences = max(1, -(-per_update // split))
    longest = planned_prompt_tokens(cfg, prompt_tokens) + cfg.rollout.max_new_tokens
    if (
        cfg.rollout.multi_turn is not None
    ):  # an episode: prompt, turns and observations up to the context limit
        longest = cfg.rollout.multi_turn.max_context_tokens
    return MicroBatchShape(sequences, round_up(longest, multiple))


@dataclass(frozen=True)
class Block:
    """One recomputable piece of a layer: bytes it keeps for the backward, and bytes its checkpoint keeps instead
    when it is recomputed (its inputs that nothing else keeps)."""

    saved: float
    kept_if_recomputed: float


def layer_blocks(cfg: RunConfig, shape: MicroBatchShape, *, moe: bool, spec: Spec) -> dict[str, Block]:
    """Bytes one decoder layer keeps for one micro-batch on one rank, block by block (no recomputation)."""
    arch, par = cfg.model.arch, cfg.parallel
    d = ACTIVATION_BYTES[cfg.precision.dtype]
    h, hd, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    t = par.tp
    tokens = shape.tokens / par.cp
    tt = (
        tokens / t if par.sequence_parallel else tokens
    )  # tokens of the sequence-parallel [s/t, b, h] tensors
    heads = tokens / t  # per-token factor of head-sharded tensors: (nq·hd/t) per token
    qkv = (nq + 2 * nkv) * hd * d
    if spec == "te":
        norm_linear = tt * (2 * h * d + 4)  # TE LayerNormLinear: input, rsigma, normalised input
        blocks = {
            "attention_norm": Block(norm_linear, norm_linear),
            # q/k norms keep their inputs (views of the fused qkv output), rsigma; the projection's input is the
            # attention output (same storage), 4 bytes of the two tiny rope tables aside
            "attention": Block(heads * (qkv + 4 * (nq + nkv) + nq * hd * d), 0),
            # flash/cuDNN attention: rotated q and k, softmax statistics (v is in the qkv storage)
            "core_attention": Block(heads * ((nq + nkv) * hd * d + 4 * nq), heads * (nq + nkv) * hd * d),
        }
        if moe:
            blocks["mlp_norm"] = Block(tt * (h * d + 4), tt * (h * d + 4))
    else:
        torch_norm = tt * (8 * h + 4)  # torch RMSNorm upcasts: fp32 input copy, fp32 normalised, rstd
        s = shape.seq_len
        blocks = {
            "attention_norm": Block(torch_norm, torch_norm),
            # qkv input; q/k norms in fp32 (input copy, normalised, rstd); projection input; rope cos/sin
            "attention": Block(
                tt * h * d + heads * (8 * (nq + nkv) * hd + 4 * (nq + nkv) + nq * hd * d) + 4 * s * hd * d,
                0,
            ),
            # rotated q, k and v expanded to nq heads (GQA), probabilities in d and the fp32 softmax, causal mask
            "core_attention": Block(
                heads * 3 * nq * hd * d
                + shape.sequences * (nq / t) * s * s * (4 + (d if d != 4 else 0))
                + s * s,
                heads * ((nq + nkv) * hd * d + qkv),
            ),
            "mlp_norm": Block(torch_norm, torch_norm),
        }
    blocks.update(_mlp_blocks(cfg, tt, tokens, moe=moe, spec=spec, d=d))
    return blocks


def _mlp_blocks(
    cfg: RunConfig, tt: float, tokens: float, *, moe: bool, spec: Spec, d: int
) -> dict[str, Block]:
    arch, par = cfg.model.arch, cfg.parallel
    h = arch.hidden_size
    if not moe:
        width = arch.intermediate_size / par.tp
        if spec == "te":  # pre-MLP norm fused into fc1: input, rsigma, normalised; fc1 output; activation
            return {"mlp": Block(tt * (2 * h * d + 4) + tokens * 3 * width * d, tt * h * d)}
        # fc1 input; fc1 output, silu output, the gate half's copy, fc2 input
        return {"mlp": Block(tt * h * d + tokens * 5 * width * d, tt * h * d)}
    k, experts = arch.num_experts_per_tok, arch.num_experts
    routed = tt * k * par.etp  # expert-TP ranks all see their group's tokens (tt already split over TP)
    width = arch.moe_intermediate_size / par.etp
    # router input, top-k indices and probabilities, the routing map (bool and fp32), the sort's indices
    router = tt * (h * d + 20 * k + 5 * experts)
    if spec == "te":  # grouped GEMMs: fc1 input, fc1 output, activation (fc2 input), the routing weight
        per_routed = h * d + 3 * width * d + 4
    else:  # sequential experts: fc1 input, fc1 output, silu output, gate half, weighted output, fc2 input
        per_routed = h * d + 6 * width * d + 4
    return {"router": Block(router, tt * h * d), "experts": Block(routed * per_routed, 0)}


def recomputed_blocks(cfg: RunConfig, *, moe: bool) -> set[str]:
    """The blocks of a layer that ``model.recompute`` recomputes in the backward."""
    model = cfg.model
    if model.recompute == "full":
        return {"attention_norm", "attention", "core_attention", "mlp_norm", "mlp", "router", "experts"}
    chosen = set()
    for module in model.selective_modules:
        if module == "core_attn":
            chosen.add("core_attention")
        elif module == "mlp" and not moe:
            chosen.add("mlp")
        elif module == "moe" and moe:
            chosen |= {"router", "experts"}
    return chosen


@dataclass(frozen=True)
class LayerMemory:
    """One decoder layer, one micro-batch: bytes kept until the backward, and the extra bytes its recomputation
    re-creates during the backward."""

    kept: float
    recompute_peak: float
    blocks: dict[str, float]
    largest_block: float  # saved bytes of the largest block: about what its backward allocates at once


def layer_memory(cfg: RunConfig, shape: MicroBatchShape, *, moe: bool, spec: Spec) -> LayerMemory:
    blocks = layer_blocks(cfg, shape, moe=moe, spec=spec)
    par, d = cfg.parallel, ACTIVATION_BYTES[cfg.precision.dtype]
    if cfg.model.recompute == "full":  # each layer keeps only its input, the hidden state [s/t, b, h]
        tt = shape.tokens / par.cp / (par.tp if par.sequence_parallel else 1)
        total = sum(b.saved for b in blocks.values())
        kept = tt * cfg.model.arch.hidden_size * d
        return LayerMemory(kept, total, {"layer_input": kept}, max(b.saved for b in blocks.values()))
    chosen = recomputed_blocks(cfg, moe=moe)
    kept_blocks = {name: (b.kept_if_recomputed if name in chosen else b.saved) for name, b in blocks.items()}
    if "moe_act" in cfg.model.selective_modules and moe:
        kept_blocks["experts"] -= _expert_activation_bytes(cfg, shape)
    recompute_peak = sum(b.saved - b.kept_if_recomputed for name, b in blocks.items() if name in chosen)
    largest = max(b.saved for b in blocks.values())
    return LayerMemory(sum(kept_blocks.values()), recompute_peak, kept_blocks, largest)


def _expert_activation_bytes(cfg: RunConfig, shape: MicroBatchShape) -> float:
    """The expert activations ``moe_act`` recomputes: ``Tt·k·etp`` routed tokens × ``Fe/etp`` values."""
    arch, par = cfg.model.arch, cfg.parallel
    tt = shape.tokens / par.cp / (par.tp if par.sequence_parallel else 1)
    d = ACTIVATION_BYTES[cfg.precision.dtype]
    return tt * arch.num_experts_per_tok * arch.moe_intermediate_size * d


def edge_bytes(
    cfg: RunConfig, shape: MicroBatchShape, *, first: bool, last: bool, spec: Spec
) -> dict[str, float]:
    """What the embedding (token ids) and the output side keep: final norm, output-layer input, the vocab-parallel
    logits [T, V/t] the log-prob kernel keeps (with its log-sum-exp, labels and mask)."""
    arch, par = cfg.model.arch, cfg.parallel
    d = ACTIVATION_BYTES[cfg.precision.dtype]
    tokens = shape.tokens / par.cp
    tt = tokens / par.tp if par.sequence_parallel else tokens
    h = arch.hidden_size
    out = {}
    if first:
        out["embedding"] = tokens * 8  # int64 ids
    if last:
        norm = tt * (h * d + 4) if spec == "te" else tt * (8 * h + 4)
        out["output"] = norm + tt * h * d + tokens * (arch.vocab_size / par.tp * d + 13)
    return out


@dataclass(frozen=True)
class StageActivations:
    """Activation memory of one pipeline stage's ranks at their peak, in bytes."""

    in_flight: int  # micro-batches whose activations are held at once (1F1B: pp - stage, at most the count)
    per_micro_batch: float  # layers + embedding/output of this stage, one micro-batch
    transient: float  # backward working memory on top (logit gradient, one block's gradients, recomputation)
    layers: dict[str, float]  # one layer of each kind, kept bytes (for the report)

    @property
    def total(self) -> float:
        return self.in_flight * self.per_micro_batch + self.transient


def vision_bytes(cfg: RunConfig, image_patches: int) -> float:
    """Bytes the vision tower keeps for the backward for ``image_patches`` ViT patches (module docstring)."""
    vision = cfg.model.arch.vision
    if vision is None or image_patches <= 0 or cfg.model.freeze_vision:
        return 0.0
    d = ACTIVATION_BYTES[cfg.precision.dtype]
    per_block = 10 * vision.hidden_size + 2 * vision.intermediate_size
    mergers = (1 + len(vision.deepstack_visual_indexes)) * 3 * vision.hidden_size
    return image_patches * (vision.depth * per_block + mergers) * d


def stage_activations(
    cfg: RunConfig,
    shape: MicroBatchShape,
    stage: int,
    layers: tuple[int, int],
    *,
    spec: Spec,
    image_patches: int = 0,
) -> StageActivations:
    """Activations of pipeline stage ``stage`` (decoder layers ``layers[0]..layers[1]-1``) for ``shape`` (and
    ``image_patches`` ViT patches per micro-batch on the first stage of a vision-language model)."""
    par = cfg.parallel
    pattern = cfg.model.arch.moe_layer_pattern()[layers[0] : layers[1]]
    kinds = {moe: layer_memory(cfg, shape, moe=bool(moe), spec=spec) for moe in set(pattern)}
    edges = edge_bytes(cfg, shape, first=stage == 0, last=stage == par.pp - 1, spec=spec)
    if stage == 0 and vision_bytes(cfg, image_patches):
        edges["vision"] = vision_bytes(cfg, image_patches)
    per_micro = sum(kinds[moe].kept for moe in pattern) + sum(edges.values())
    in_flight = min(par.pp - stage, par.micro_batches)
    # On top of what is kept, the backward holds the logits' gradient (last stage) and either what one layer's
    # recomputation re-creates or the gradients of one block being differentiated, whichever is larger
    # (the backward frees each block's saved tensors as it goes). bench/bench_planner.py measures this rule.
    # Under sequence parallelism a linear's backward re-gathers its input over the TP ranks and holds the
    # gathered gradient before the reduce-scatter: two [T, h] tensors.
    logits_grad = _logits_bytes(cfg, shape) if "output" in edges else 0.0
    gathered = 0.0
    if par.sequence_parallel and par.tp > 1:
        gathered = (
            2 * shape.tokens / par.cp * cfg.model.arch.hidden_size * ACTIVATION_BYTES[cfg.precision.dtype]
        )
    transient = logits_grad + gathered + max(max(m.recompute_peak, m.largest_block) for m in kinds.values())
    layer_report = {("moe" if moe else "dense"): kinds[moe].kept for moe in kinds}
    return StageActivations(in_flight, per_micro, transient, layer_report)


def _logits_bytes(cfg: RunConfig, shape: MicroBatchShape) -> float:
    par = cfg.parallel
    return shape.tokens / par.cp * cfg.model.arch.vocab_size / par.tp * ACTIVATION_BYTES[cfg.precision.dtype]
