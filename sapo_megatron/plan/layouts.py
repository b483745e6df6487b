"""Suggested layouts: every valid (tp, pp, ep, etp, recompute) for the config's model on a world size, planned,
and those that fit ranked by one stated rule.

Enumerated: tp dividing the query heads, the KV heads and the vocabulary, at most a node's GPUs; sequence
parallelism whenever tp > 1; pp dividing the layers; ep dividing the experts; etp 1 or tp (tp without EP, as the
config rule asks); cp 1, and cp 2, 4 or 8 when responses are long (``rollout.max_new_tokens`` ≥
:data:`LONG_RESPONSE_TOKENS`, text models: context parallelism splits each sequence, and its activations, over cp
ranks); recompute none, selective (``moe`` on MoE models, ``mlp`` on dense ones) or full. The
batch stays the config's: one sequence per micro-batch (``parallel.micro_batches`` = the rank's sequences of an
update) unless packing sets a token budget. Layouts the config validation refuses are skipped.

Ranking (first difference decides): (0) a margin of at least 10% of the GPU's memory left (room for the
estimate's error: the TE-spec terms are not measured here), (1) no recomputation, then selective, then full (full recomputation costs
about a third more compute); (2) fewer pipeline stages (bubbles, and every stage holds more micro-batches in
flight); (2b) smaller cp (its K/V exchange overlaps attention, but a smaller cp leaves more data parallelism) – so
a long-response layout that fits with cp 2 and no pipeline ranks before one that needs pp 2; (3) the expert-parallel group inside one node (``ep × etp ≤ launch.procs_per_node``: the two
all-to-alls of every MoE layer over NVLink, not the network); (4) smaller tp (two all-reduce-sized collectives
per layer); (5) larger ep (fewer experts per GPU); (6) more headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from sapo_megatron.config import ConfigError, RunConfig, validate_layout
from sapo_megatron.plan.report import Plan, PlanSettings, build_plan, layout_json

RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}
LONG_RESPONSE_TOKENS = 16384  # responses at least this long: context parallelism is among the candidates
CP_CHOICES = (1, 2, 4, 8)
MARGIN = 0.10  # of the GPU's memory: layouts leaving less rank after those leaving more


@dataclass(frozen=True)
class Suggestion:
    plan: Plan
    rank_key: tuple

    def to_json(self) -> dict:
        plan = self.plan
        return {
            "layout": layout_json(plan.cfg, plan.settings.world_size),
            "peak_gib": round(plan.peak / 1024**3, 3),
            "headroom_gib": round(min(s.headroom for s in plan.stages) / 1024**3, 3),
            "fits": plan.fits,
        }


def candidate_configs(cfg: RunConfig, world_size: int) -> list[RunConfig]:
    """Every layout of ``cfg``'s model on ``world_size`` ranks that validation accepts."""
    arch = cfg.model.arch
    node = max(1, cfg.launch.procs_per_node)
    out = []
    for tp in _divisors(world_size):
        if (
            tp > node
            or arch.num_attention_heads % tp
            or arch.num_key_value_heads % tp
            or arch.vocab_size % tp
        ):
            continue
        for pp in _divisors(world_size // tp):
            if arch.num_hidden_layers % pp:
                continue
            for cp in _cp_choices(cfg, world_size // (tp * pp)):
                for ep, etp in _expert_layouts(cfg, world_size // pp, tp):
                    for recompute in _recompute_choices(cfg):
                        layout = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp}
                        candidate = _with_layout(cfg, world_size, layout, recompute=recompute)
                        if candidate is not None:
                            out.append(candidate)
    return out


def _cp_choices(cfg: RunConfig, ranks: int) -> list[int]:
    """Context-parallel sizes worth planning: 1, and for long responses of a text model those of
    :data:`CP_CHOICES` that divide the ranks left after tp × pp."""
    if cfg.rollout.max_new_tokens < LONG_RESPONSE_TOKENS or cfg.model.arch.is_vl:
        return [1]
    return [cp for cp in CP_CHOICES if ranks % cp == 0]


def _expert_layouts(cfg: RunConfig, ranks_per_stage: int, tp: int) -> list[tuple[int, int]]:
    arch = cfg.model.arch
    if not arch.is_moe:
        return [(1, tp)]
    out = []
    for ep in _divisors(arch.num_experts):
        for etp in sorted({1, tp}):
            if ep == 1 and etp != tp:
                continue
            if ranks_per_stage % (ep * etp) == 0:
                out.append((ep, etp))
    return out


def _recompute_choices(cfg: RunConfig) -> list[dict]:
    selective = "moe" if cfg.model.arch.is_moe else "mlp"
    return [
        {"recompute": "none", "recompute_modules": None},
        {"recompute": "selective", "recompute_modules": [selective]},
        {"recompute": "full", "recompute_modules": None},
    ]


def _with_layout(cfg: RunConfig, world: int, layout: dict[str, int], *, recompute: dict):
    tp = layout["tp"]
    dp = world // (tp * layout["pp"] * layout["cp"])
    per_update = cfg.rollout.n_samples * cfg.trainer.prompts_per_step // cfg.trainer.mini_batches
    packed = cfg.parallel.max_tokens_per_micro_batch is not None
    if not packed and per_update % dp:
        return None
    micro_batches = cfg.parallel.micro_batches if packed else per_update // dp
    parallel = cfg.parallel.model_copy(update={**layout, "sequence_parallel": tp > 1})
    parallel = parallel.model_copy(update={"micro_batches": micro_batches})
    model = cfg.model.model_copy(update=recompute)
    candidate = cfg.model_copy(update={"parallel": parallel, "model": model})
    try:
        validate_layout(candidate, world)
    except ConfigError:
        return None
    return candidate


def rank_key(plan: Plan) -> tuple:
    cfg, par = plan.cfg, plan.cfg.parallel
    node = max(1, cfg.launch.procs_per_node)
    ep_leaves_node = int(par.ep * par.etp > node) if cfg.model.arch.is_moe else 0
    headroom = min(stage.headroom for stage in plan.stages)
    tight = int(headroom < MARGIN * plan.gpu_memory)
    return (
        tight,
        RECOMPUTE_COST[cfg.model.recompute],
        par.pp,
        par.cp,
        ep_leaves_node,
        par.tp,
        -par.ep,
        -headroom,
    )


def suggest_layouts(cfg: RunConfig, settings: PlanSettings, top: int = 5) -> list[Suggestion]:
    """The ``top`` best layouts that fit on ``settings.world_size`` GPUs, best first (see the module's rule)."""
    plans = [build_plan(candidate, settings) for candidate in candidate_configs(cfg, settings.world_size)]
    fitting = [Suggestion(plan, rank_key(plan)) for plan in plans if plan.fits]
    return sorted(fitting, key=lambda s: s.rank_key)[:top]


def format_suggestions(suggestions: list[Suggestion], settings: PlanSettings) -> str:
    if not suggestions:
        return f"no layout of this model fits on {settings.world_size} GPUs with this batch and GPU memory"
    lines = [
        f"layouts that fit on {settings.world_size} GPUs, best first (rule: docs/planning.md):",
        f"{'#':>2} {'tp':>3} {'pp':>3} {'cp':>3} {'dp':>4} {'ep':>4} {'etp':>4} {'recompute':<16} {'micro-b.':>8} "
        f"{'peak GiB':>9} {'headroom':>9}",
    ]
    for i, s in enumerate(suggestions, 1):
        layout = layout_json(s.plan.cfg, settings.world_size)
        recompute = layout["recompute"] + (
            f" {','.join(layout['recompute_modules'])}" if layout["recompute_modules"] else ""
        )
        headroom = min(st.headroom for st in s.plan.stages) / 1024**3
        lines.append(
            f"{i:>2} {layout['tp']:>3} {layout['pp']:>3} {layout['cp']:>3} {layout['dp']:>4} {layout['ep']:>4} {layout['etp']:>4} "
            f"{recompute:<16} {layout['micro_batches']:>8} {s.plan.peak / 1024**3:>9.2f} {headroom:>9.2f}"
        )
    return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
