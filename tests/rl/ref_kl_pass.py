"""A made-up capability as a new one would plug in: one module (this one) with its part and its pass, and one
registration line in ``STEP_PASSES``. The part: per micro-batch, the k3 of the reference policy against the old
policy on the response tokens, from the ``old_logp`` and ``ref_logp`` the passes before it added; its metric
``test/ref_kl_old`` is the step's token mean. The scenario runs a short RL job with the pass registered and a loss
hook that records the part each micro-batch brings (spawned by tests/rl/test_step_passes.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from sapo_megatron.loop.passes import StepContext, StepPass
from sapo_megatron.model.step_batch import StepBatch


@dataclass(frozen=True)
class RefKl:
    """One micro-batch's part: the token sum of k3(ref ‖ old) and the token count."""

    k3_sum: float
    tokens: float


@dataclass(frozen=True)
class RefKlPart:
    per_micro_batch: list[RefKl]
    metrics: Mapping[str, float] = field(default_factory=dict)

    def apply(self, batch: StepBatch) -> None:
        for micro, part in zip(batch.micro_batches(), self.per_micro_batch):
            micro.set_part(part)


def ref_kl(batch: StepBatch) -> RefKlPart:
    parts = []
    for micro in batch.micro_batches():
        assert micro.old_logp is not None and micro.ref_logp is not None and micro.loss_mask is not None
        mask = micro.loss_mask.bool()
        log_ratio = (micro.ref_logp - micro.old_logp)[mask].double()
        parts.append(RefKl(float((log_ratio.exp() - log_ratio - 1).sum()), float(mask.sum())))
    total = sum(p.k3_sum for p in parts) / max(sum(p.tokens for p in parts), 1.0)
    return RefKlPart(parts, {"test/ref_kl_old": total})


def ref_kl_pass(ctx: StepContext) -> StepPass | None:
    """Registered after the reference pass: it needs ``ref_logp``."""
    return ref_kl if ctx.reference is not None else None


def run_with_pass(output_dir: str) -> None:
    """A short RL job with :func:`ref_kl_pass` registered into ``output_dir``; what the loss hook saw of the part
    goes to ``output_dir/seen.json``."""
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.defaults import embedded_default_dict
    from sapo_megatron.loop import trainer
    from sapo_megatron.megatron.loss_hook import PolicyLossHook

    seen: list[RefKl | None] = []

    class RecordingHook(PolicyLossHook):
        def __call__(self, logits, batch):  # type: ignore[no-untyped-def]
            seen.append(batch.part(RefKl))
            return super().__call__(logits, batch)

    trainer.STEP_PASSES.append(ref_kl_pass)  # the one registration line
    trainer.PolicyLossHook = RecordingHook  # type: ignore[misc]  # only to observe what the loss gets
    cfg = embedded_default_dict()
    cfg.update(output_dir=output_dir)
    cfg["sft"].update(steps=2, log_every=1)
    cfg["trainer"].update(steps=2, prompts_per_step=4, log_ref_kl=True, export_hf=False, save_every=0)
    cfg["eval"] = {"every": 0, "datasets": []}
    trainer.run(config_from_dict(cfg), mode="overwrite")
    if dist.is_initialized():
        dist.destroy_process_group()
    seen_values = [None if p is None else [p.k3_sum, p.tokens] for p in seen]
    Path(output_dir, "seen.json").write_text(json.dumps(seen_values))


if __name__ == "__main__":
    run_with_pass(sys.argv[1])
