"""The logit-parity check: one token batch through HF transformers and through the Megatron model loaded from a
Megatron checkpoint, under any parallel layout; reports the logit differences and any weight that differs."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sapo_megatron.checkpoint import atomic
from sapo_megatron.checkpoint.hf_io import HFCheckpointReader
from sapo_megatron.checkpoint.mapping import hf_expected_shapes
from sapo_megatron.conversion.params import ConversionError, checkpoint_hf_config, read_hf_config
from sapo_megatron.model.arch import QwenArch

if TYPE_CHECKING:
    from sapo_megatron.config import RunConfig

DEFAULT_TOLERANCE = {"fp32": 1e-3, "bf16": 0.25}
"""Default bound on max |Δlogit| by compute dtype (the tests hold tiny models to 1e-4 in fp32)."""


@dataclass(frozen=True)
class ParityReport:
    """HF vs Megatron logits on one token batch."""

    max_abs: float
    mean_abs: float
    cosine: float
    tolerance: float
    dtype: str
    tokens: int
    differing: tuple[str, ...] = ()
    """HF tensors whose weights in the Megatron model differ from ``hf_dir``'s (after a cast to its dtype)."""

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tolerance and not self.differing

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        weights = (
            f"; {len(self.differing)} tensors differ from the HF checkpoint: {', '.join(self.differing[:5])}"
            if self.differing
            else "; every weight equals the HF checkpoint's"
        )
        return (
            f"logit parity ({self.dtype}, {self.tokens} tokens): max |Δlogit| = {self.max_abs:.3e}, "
            f"mean |Δlogit| = {self.mean_abs:.3e}, cosine = {self.cosine:.8f}; "
            f"tolerance max |Δlogit| <= {self.tolerance:.1e}{weights}: {verdict}"
        )


def verify(
    hf_dir: str | Path,
    megatron_dir: str | Path,
    *,
    tolerance: float | None = None,
    dtype: str = "fp32",
    batch: int = 2,
    seq_len: int = 32,
    seed: int = 0,
    parallel: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = print,
) -> ParityReport:
    """Run the same random token batch through HF transformers (from ``hf_dir``) and through the Megatron
    model loaded from ``megatron_dir``; compare the logits. A vision-language model gets rows of text and
    seeded images of several sizes (and a text-only row when ``batch`` >= 3); padding is not compared.

    Runs in the current process group when one exists (under ``torchrun``: every rank calls it, ``parallel``
    gives the layout, e.g. ``{"tp": 2, "sequence_parallel": True}``), else in a single process. The HF model
    runs on one rank of the last pipeline stage; every rank returns the same report.
    """
    import torch.distributed as dist

    from sapo_megatron.megatron import dist_ckpt
    from sapo_megatron.megatron.forward import forward_logits
    from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
    from sapo_megatron.megatron.parallel import is_reporting_rank, parallel_context

    hf_dir = Path(hf_dir)
    mc_path = atomic.find_checkpoint(megatron_dir)
    atomic.read_marker(mc_path)
    _, arch = read_hf_config(hf_dir)
    stored = checkpoint_hf_config(mc_path, hf_dir)
    if QwenArch.from_hf_dict(stored) != arch:
        raise ConversionError(
            f"{mc_path}/{atomic.HF_CONFIG} and {hf_dir}/config.json describe different models"
        )
    tolerance = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    cfg = _parity_config(arch, dtype, parallel)
    inputs = _parity_inputs(arch, batch, seq_len, seed)
    ids, real = inputs["input_ids"], inputs["attention_mask"].bool()
    vision = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    with parallel_context(cfg, seed=seed):
        model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
        dist_ckpt.load_model_weights(model, mc_path)
        logits = forward_logits(model, ids, **vision)
        figures = torch.zeros(4, dtype=torch.float64)
        if logits is not None and is_reporting_rank():
            figures = _compare(logits.cpu()[real], _hf_logits(hf_dir, inputs, dtype, arch)[real])
        figures = figures.to(_collective_device())
        dist.all_reduce(figures)
        figures = figures.cpu()
        differing = _differing_weights(model, arch, hf_dir)
        rank = dist.get_rank()
    report = ParityReport(
        max_abs=float(figures[0]),
        mean_abs=float(figures[1]),
        cosine=float(figures[2]),
        tolerance=tolerance,
        dtype=dtype,
        tokens=int(real.sum()),
        differing=differing,
    )
    if log is not None and rank == 0:
        log(report.summary())
    return report


def _parity_config(arch: QwenArch, dtype: str, parallel: dict[str, Any] | None) -> RunConfig:
    """A run config for ``arch`` in ``dtype`` under the ``parallel`` layout, over the launcher's world."""
    import torch.distributed as dist

    from sapo_megatron.config import config_from_dict

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return config_from_dict(
        {
            "model": {"hf_config": arch.to_hf_dict()},
            "parallel": parallel or {},
            "precision": {"dtype": dtype},
            "launch": {"procs_per_node": world},
        }
    )


def _differing_weights(model: torch.nn.Module, arch: QwenArch, hf_dir: Path) -> tuple[str, ...]:
    """Collective: the HF tensors (in HF order) whose copy in the loaded model is not bitwise the HF file's
    (after casting the file's to the model's dtype). Names a perturbed tensor that the logits may hide."""
    import torch.distributed as dist

    from sapo_megatron.megatron.weights import iter_hf_weights

    reader = HFCheckpointReader(hf_dir)
    try:
        mine = [
            name
            for name, tensor in iter_hf_weights(model, arch, owned_only=True)
            if not torch.equal(reader.get(name).to(tensor.dtype), tensor.cpu())
        ]
    finally:
        reader.close()
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    order = {name: i for i, name in enumerate(hf_expected_shapes(arch))}
    return tuple(sorted({n for names in gathered for n in names}, key=order.__getitem__))


def _collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _parity_inputs(arch: QwenArch, batch: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """Random tokens ``[batch, seq_len]``; for a vision-language model, rows of text and seeded images of
    several sizes (two images, one image, text only, in turn), right-padded, with their processor outputs."""
    if not arch.is_vl:
        ids = torch.randint(
            0, arch.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed)
        )
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    from sapo_megatron.model.tiny import vl_batch

    unit = (
        arch.vl.vision.patch_size * arch.vl.vision.spatial_merge_size
    )  # one merged token per unit × unit pixels
    text = max(seq_len // 4, 1)
    patterns: list[list[int | tuple[int, int]]] = [
        [text, (2 * unit, 2 * unit), text, (unit, 2 * unit), text],
        [text, (2 * unit, unit), 2 * text],
        [seq_len],
    ]
    return vl_batch(arch, [patterns[i % 3] for i in range(batch)], seed=seed)


def _hf_logits(hf_dir: Path, inputs: dict[str, torch.Tensor], dtype: str, arch: QwenArch) -> torch.Tensor:
    import transformers

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    model_cls = transformers.AutoModelForImageTextToText if arch.is_vl else transformers.AutoModelForCausalLM
    from sapo_megatron.checkpoint.fused_experts import transpose_square_hub_experts

    # transformers types .to() oddly; a hub-layout VL-MoE with H = I loads with experts left untransposed
    loaded: torch.nn.Module = transpose_square_hub_experts(model_cls.from_pretrained(str(hf_dir)), hf_dir)
    model = loaded.to(torch_dtype).eval()
    if not arch.is_vl:
        inputs = {"input_ids": inputs["input_ids"]}
    with torch.no_grad():
        return model(**inputs).logits.float()


def _compare(mc: torch.Tensor, hf: torch.Tensor) -> torch.Tensor:
    if mc.shape != hf.shape:
        raise ConversionError(f"logit shapes differ: Megatron {tuple(mc.shape)}, HF {tuple(hf.shape)}")
    diff = (mc.double() - hf.double()).abs()
    cosine = torch.nn.functional.cosine_similarity(mc.double().flatten(), hf.double().flatten(), dim=0)
    return torch.stack([diff.max(), diff.mean(), cosine, torch.ones((), dtype=torch.float64)])
