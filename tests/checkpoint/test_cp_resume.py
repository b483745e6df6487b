"""A training state (weights, distributed Adam state, schedule) saved at ``parallel.cp: 2`` resumes at cp 1, and
one saved at cp 1 resumes at cp 2: the next step's loss, gradient norm and updated weights are those of the run
that kept going (fp32, tiny Qwen3-MoE; Megatron's distributed checkpoint reshards the optimizer state, which CP
splits over data × context parallel ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = pytest.mark.slow

LAYOUTS = {"cp1": (1, {}), "cp2": (2, {"cp": 2})}


def _spawn(hf_dir: str, layout: str, mode: str, root, batches) -> dict:
    world, parallel = LAYOUTS[layout]
    payload = {"hf_dir": hf_dir, "parallel": parallel, "mode": mode, "root": str(root), "batches": batches}
    ranks = run_distributed("tests.checkpoint.scenarios:cp_save_or_resume", world, payload)
    weights: dict[str, torch.Tensor] = {}
    for rank in ranks:
        assert not set(weights) & set(rank["weights"]), "a tensor was exported by two ranks"
        weights.update(rank["weights"])
    return {"step": ranks[0]["step"], "weights": weights}


@pytest.mark.parametrize(("saved", "resumed"), [("cp2", "cp1"), ("cp1", "cp2")])
def test_train_state_resumes_across_context_parallel_sizes(hf_checkpoints, tmp_path, saved, resumed):
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 64, (2, 33), generator=gen) for _ in range(2)]
    hf_dir = str(hf_checkpoints["moe-fp32"])
    kept_going = _spawn(hf_dir, saved, "save", tmp_path, batches)
    resumed_run = _spawn(hf_dir, resumed, "resume", tmp_path, batches)
    assert resumed_run["step"] == pytest.approx(kept_going["step"], rel=1e-5)
    assert set(resumed_run["weights"]) == set(kept_going["weights"])
    worst = max(
        float((resumed_run["weights"][n] - kept_going["weights"][n]).abs().max())
        for n in kept_going["weights"]
    )
    assert worst <= 1e-6, f"updated weights differ by {worst:.3g}"
