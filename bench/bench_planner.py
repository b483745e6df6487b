"""The planner's activation formula against measured activations: a Qwen3(-MoE)-shaped model (Megatron's local
spec, bf16) runs one forward + backward on CPU per case, and the planner's estimate for the same layout and
micro-batch is printed next to what was measured, as ratios (planner / measured):

- kept: what autograd keeps for the backward at the end of the forward (distinct non-parameter storages),
  against the planner's per-micro-batch activations;
- peak: the allocator's peak over forward + backward (torch profiler memory events), against the planner's
  activations + backward working memory.

Megatron-LM's own formula (``megatron/training/theoretical_memory_usage.py``, Korthikanti et al. Table 2 with
selective recomputation: ``s·b·h·(18 + 4·ffn/h)/t`` per layer, dense FFN only) is printed as a second reference.

    python bench/bench_planner.py [--seq 256] [--batch 2] [--layers 4] [--threads 1] [--quick]

Layouts: single rank (dense; MoE without recomputation, selective core_attn / moe, full), and TP2+SP, EP2 on two
gloo ranks. Goal: |ratio - 1| ≤ 0.05 for kept, ≤ 0.25 for peak.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # moe / dense
    world: int = 1
    parallel: tuple[tuple[str, object], ...] = ()
    recompute: str = "none"  # none / full / comma-separated selective modules


CASES = [
    Case("dense", "dense"),
    Case("moe", "moe"),
    Case("moe, selective core_attn", "moe", recompute="core_attn"),
    Case("moe, selective moe", "moe", recompute="moe"),
    Case("moe, full recompute", "moe", recompute="full"),
    Case("moe, tp2+sp", "moe", 2, (("tp", 2), ("sequence_parallel", True))),
    Case("moe, ep2", "moe", 2, (("ep", 2),)),
]


def case_config(case: Case, layers: int, seq: int, batch: int):
    """The run config of a case: a small Qwen3-MoE shape (hidden 256, 8 q / 2 kv heads, 16 experts top-4)."""
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.model.tiny import tiny_hf_config

    moe = (
        {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128}
        if case.kind == "moe"
        else {}
    )
    hf = tiny_hf_config(
        case.kind,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=2048,
        max_position_embeddings=max(4096, seq),
        **moe,
    )
    model: dict = {"hf_config": hf}
    if case.recompute == "full":
        model["recompute"] = "full"
    elif case.recompute != "none":
        model.update(recompute="selective", recompute_modules=case.recompute.split(","))
    return config_from_dict(
        {
            "model": model,
            "parallel": dict(case.parallel),
            "precision": {"dtype": "bf16"},
            "launch": {"procs_per_node": case.world},
            "rollout": {"n_samples": batch * case.world},
            "trainer": {"prompts_per_step": 1},
        }
    )


def measure_rank(payload: dict) -> dict:
    """On one rank: build the case's model, measure, and return the numbers with the planner's estimate."""
    from sapo_megatron.megatron.activation_probe import measure_activations
    from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.plan.activations import MicroBatchShape, stage_activations

    torch.set_num_threads(payload["threads"])
    case, seq, batch = payload["case"], payload["seq"], payload["batch"]
    cfg = case_config(case, payload["layers"], seq, batch)
    info = init_parallel(cfg.parallel, seed=0)
    model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
    ids = torch.randint(
        0, cfg.model.arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(info.dp_rank)
    )
    measured = measure_activations(model, ids)
    est = stage_activations(cfg, MicroBatchShape(batch, seq), 0, (0, payload["layers"]), spec="local")
    return {
        "kept": measured.saved,
        "peak": measured.peak,
        "est_kept": est.per_micro_batch,
        "est_peak": est.per_micro_batch + est.transient,
        "megatron": megatron_formula(cfg, batch, seq),
    }


def megatron_formula(cfg, batch: int, seq: int) -> float:
    """Megatron-LM's ``compute_activation_memory`` (SP + selective recompute), pipeline size 1, in bytes."""
    arch, tp = cfg.model.arch, cfg.parallel.tp
    ffn = arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size
    sbh = seq * batch * arch.hidden_size
    per_layer = sbh * (18 + 4 * ffn / arch.hidden_size)
    total = per_layer * arch.num_hidden_layers + 8 * seq * batch + sbh
    total += sbh * 4 * (1 + arch.vocab_size / arch.hidden_size)
    return total / tp


def run_case(case: Case, payload: dict) -> list[dict]:
    """Every rank's numbers for ``case`` (fresh processes, so that the allocator starts clean)."""
    from tests.distributed import run_distributed

    return run_distributed(
        "bench.bench_planner:measure_rank", case.world, {**payload, "case": case}, timeout=600
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="single-rank cases only")
    parser.add_argument("--only", help="run the cases whose name contains this text")
    args = parser.parse_args(argv)
    payload = {"seq": args.seq, "batch": args.batch, "layers": args.layers, "threads": args.threads}
    print(
        f"Qwen3-MoE-shaped model, {args.layers} layers, hidden 256, bf16, local spec; micro-batch "
        f"{args.batch} x {args.seq} tokens (per rank)\n"
    )
    print(
        f"{'case':<26} {'rank':>4} {'kept MiB':>9} {'planner':>8} {'ratio':>6} {'peak MiB':>9} {'planner':>8} "
        f"{'ratio':>6} {'Megatron-LM':>12} {'ratio':>6}"
    )
    worst_kept = worst_peak = 0.0
    for case in CASES:
        if (args.quick and case.world > 1) or (args.only and args.only not in case.name):
            continue
        for rank, r in enumerate(run_case(case, payload)):
            kept_ratio, peak_ratio = r["est_kept"] / r["kept"], r["est_peak"] / r["peak"]
            worst_kept, worst_peak = (
                max(worst_kept, abs(kept_ratio - 1)),
                max(worst_peak, abs(peak_ratio - 1)),
            )
            print(
                f"{case.name:<26} {rank:>4} {r['kept'] / MIB:>9.2f} {r['est_kept'] / MIB:>8.2f} {kept_ratio:>6.3f} "
                f"{r['peak'] / MIB:>9.2f} {r['est_peak'] / MIB:>8.2f} {peak_ratio:>6.3f} "
                f"{r['megatron'] / MIB:>12.2f} {r['megatron'] / r['peak']:>6.3f}"
            )
    print(f"\nworst |ratio - 1|: kept {worst_kept:.3f}, peak {worst_peak:.3f} (goal ≤ 0.05 / ≤ 0.25)")
    return 0 if worst_kept <= 0.05 and worst_peak <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
