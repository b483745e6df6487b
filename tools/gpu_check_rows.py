"""The rows of tools/gpu_check.py: each method of :class:`Checks` checks one thing on the device it is given
(CUDA, or the CPU under ``--allow-cpu``) and returns the detail of its table row; it raises :class:`SkipCheck`
when the row cannot run here and any other exception when it fails. gpu_check.py chooses the rows, says before
it starts which will SKIP and why, and prints the table."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch


class SkipCheck(Exception):
    """A check that cannot run here (the reason is reported)."""


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _CpGroup:
    """What Megatron's THD RoPE reads of a context-parallel group: its size and this rank (one GPU has no CP)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class Checks:
    """The checks, sharing one parallel state and one tiny checkpoint per model kind."""

    def __init__(self, workdir: Path, device: torch.device) -> None:
        from sapo_megatron.model.tiny import make_tiny_hf_checkpoint

        self.device = device
        self.workdir = workdir
        self.recipe_runs: dict[str | None, dict] = {}
        self.packing_runs: dict[str, str] = {}
        self.hf_dirs = {
            kind: make_tiny_hf_checkpoint(workdir / kind, kind, seed=0) for kind in ("moe", "dense", "vl_moe")
        }

    def config(self, kind: str, dtype: str = "fp32"):
        from sapo_megatron.config import config_from_dict

        hf_dir = str(self.hf_dirs[kind])
        return config_from_dict(
            {
                "model": {"hf_config": hf_dir, "init": "hf", "init_path": hf_dir},
                "precision": {"dtype": dtype},
                "optimizer": {"lr": 1e-3},
            }
        )

    def parity(self, kind: str, use_te: bool) -> str:
        """fp32 logits of our model (local or TE spec) against transformers' on the same checkpoint and tokens."""
        if use_te and not have("transformer_engine"):
            raise SkipCheck("transformer_engine is not installed")
        ref, got = self._parity_logits(kind, use_te, torch.float32)
        diff = (ref - got).abs().max().item()
        tolerance = 1e-4 if not use_te else 5e-3  # TE fuses norms/GEMMs (TF32 may be on)
        if diff > tolerance:
            raise AssertionError(f"max |Δlogit| {diff:.3g} > {tolerance}")
        return f"max |Δlogit| {diff:.2e} (tolerance {tolerance})"

    def parity_bf16(self, kind: str) -> str:
        """Local spec in bf16 against transformers in fp32: our bf16 error may be at most twice transformers' own
        bf16 error (both models in bf16 on the same weights, tokens and device) plus 1e-2."""
        ref, _ = self._parity_logits(kind, False, torch.float32)
        hf_bf16, ours_bf16 = self._parity_logits(kind, False, torch.bfloat16)
        hf_err = (hf_bf16 - ref).abs().max().item()
        our_err = (ours_bf16 - ref).abs().max().item()
        bound = 2 * hf_err + 1e-2
        detail = f"bf16 max |Δlogit| vs fp32 HF: ours {our_err:.3g}, transformers' {hf_err:.3g} (bound {bound:.3g})"
        if not our_err <= bound:
            raise AssertionError(detail)
        return detail

    def _parity_logits(
        self, kind: str, use_te: bool, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(transformers' logits, ours) in fp32, both models cast to ``dtype``; 2 rows of 32 seeded tokens."""
        import transformers

        from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
        from sapo_megatron.megatron.train_step import init_weights

        cfg = self.config(kind)
        model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision, use_te=use_te))
        init_weights(model, cfg)
        model = model.to(device=self.device, dtype=dtype).eval()
        hf = transformers.AutoModelForCausalLM.from_pretrained(self.hf_dirs[kind], dtype=torch.float32)
        hf = hf.to(device=self.device, dtype=dtype).eval()
        ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0)).to(self.device)
        with torch.no_grad():
            ref = hf(ids).logits.float()
            got = model(ids, torch.arange(32, device=self.device).expand(2, -1), attention_mask=None).float()
        return ref, got

    def vl_batch(self) -> dict:
        from sapo_megatron.model.arch import QwenArch
        from sapo_megatron.model.tiny import vl_batch

        arch = QwenArch.from_path(self.hf_dirs["vl_moe"])
        rows = [[5, (32, 48), 7, (16, 16), 3], [4, (40, 24), 9], [12], [2, (16, 32), 8]]
        return vl_batch(arch, rows, seed=2)

    def vl_parity(self, use_te: bool) -> str:
        """Qwen3-VL-MoE: logits on text + image rows (images of several sizes, a text-only row) vs transformers."""
        import transformers

        from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
        from sapo_megatron.megatron.train_step import init_weights

        if use_te and not have("transformer_engine"):
            raise SkipCheck("transformer_engine is not installed")
        cfg = self.config("vl_moe")
        model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision, use_te=use_te))
        init_weights(model, cfg)
        model = model.to(self.device).eval()
        hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
            self.hf_dirs["vl_moe"], dtype=torch.float32
        )
        hf = hf.to(self.device).eval()
        batch = _to(self.vl_batch(), self.device)
        images = {k: batch[k] for k in ("pixel_values", "image_grid_thw")}
        with torch.no_grad():
            ref = hf(**batch).logits.float()
            got = model(batch["input_ids"], None, None, **images).float()
        real = batch["attention_mask"].bool()
        diff = (ref - got)[real].abs().max().item()
        tolerance = 1e-4 if not use_te else 5e-3
        if diff > tolerance:
            raise AssertionError(f"max |Δlogit| {diff:.3g} > {tolerance}")
        return f"max |Δlogit| {diff:.2e} over {int(real.sum())} tokens, {len(batch['image_grid_thw'])} images (tolerance {tolerance})"

    def vl_train_steps(self, dtype: str) -> str:
        """Qwen3-VL-MoE: SFT steps on text + image rows (gradients reach the vision tower)."""
        from sapo_megatron.megatron.sft import sft_loss
        from sapo_megatron.megatron.train_step import TrainEngine

        if dtype == "fp8" and not have("transformer_engine"):
            raise SkipCheck("FP8 needs transformer_engine, which is not installed")
        engine = TrainEngine(self.config("vl_moe", dtype))
        batch = self.vl_batch()
        ids, mask = batch["input_ids"], batch["attention_mask"]
        micro = _to(
            {
                "input_ids": ids[:, :-1].contiguous(),
                "labels": ids[:, 1:].contiguous(),
                "loss_mask": mask[:, 1:].contiguous(),
                "num_tokens_global": mask[:, 1:].sum().float(),
                "pixel_values": batch["pixel_values"],
                "image_grid_thw": batch["image_grid_thw"],
            },
            self.device,
        )
        patch = next(
            p for n, p in engine.module.named_parameters() if n.endswith("visual.patch_embed.proj.weight")
        )
        before = patch.detach().float().clone()
        first = engine.train_step([micro], sft_loss)
        for _ in range(3):
            last = engine.train_step([micro], sft_loss)
        if not last.loss < first.loss:
            raise AssertionError(f"SFT loss did not fall: {first.loss:.4f} -> {last.loss:.4f}")
        moved = (patch.detach().float() - before).abs().max().item()
        if not moved > 0:
            raise AssertionError("the vision tower's patch embedding did not change")
        return f"SFT loss {first.loss:.3f} -> {last.loss:.3f}; patch embedding moved by {moved:.2e}"

    def train_steps(self, kind: str, dtype: str) -> str:
        from sapo_megatron.megatron.loss_hook import LogprobOutput, PolicyLossHook, add_global_normalisers
        from sapo_megatron.megatron.sft import sft_loss
        from sapo_megatron.megatron.train_step import TrainEngine
        from sapo_megatron.model.batching import TrainSequence, build_micro_batches

        if dtype == "fp8" and not have("transformer_engine"):
            raise SkipCheck("FP8 needs transformer_engine, which is not installed")
        engine = TrainEngine(self.config(kind, dtype))
        gen = torch.Generator().manual_seed(1)
        seqs = [
            TrainSequence(
                torch.randint(3, 64, (8,), generator=gen).tolist(),
                torch.randint(3, 64, (8,), generator=gen).tolist(),
                advantage=float(i % 3 - 1),
            )
            for i in range(16)
        ]
        micro = add_global_normalisers(
            [
                _to(b, self.device)
                for b in build_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batches=2, pad_id=0)
            ]
        )
        first = engine.train_step(micro, sft_loss)
        for _ in range(3):
            last = engine.train_step(micro, sft_loss)
        if not last.loss < first.loss:
            raise AssertionError(f"SFT loss did not fall: {first.loss:.4f} -> {last.loss:.4f}")
        for batch, logp in zip(micro, engine.forward_only(micro, LogprobOutput())):
            batch["old_logp"] = logp
        start = time.perf_counter()
        rl = engine.train_step(micro, PolicyLossHook({"name": "sapo"}))
        step_ms = (time.perf_counter() - start) * 1e3
        if not (torch.isfinite(torch.tensor(rl.loss)) and torch.isfinite(torch.tensor(rl.grad_norm))):
            raise AssertionError(f"SAPO step not finite: loss {rl.loss}, grad norm {rl.grad_norm}")
        return f"SFT loss {first.loss:.3f} -> {last.loss:.3f}; SAPO step loss {rl.loss:.4f}, {step_ms:.0f} ms"

    def offload_round_trip(self, kind: str) -> str:
        """Trainer offload (colocation): after a step, offload everything, check the device memory it frees
        (allocator figures on a GPU), onload, and compare parameters and optimizer state bit for bit."""
        from sapo_megatron.megatron.loss_hook import add_global_normalisers
        from sapo_megatron.megatron.offload import TrainerOffload
        from sapo_megatron.megatron.sft import sft_loss
        from sapo_megatron.megatron.train_step import TrainEngine
        from sapo_megatron.model.batching import TrainSequence, build_micro_batches

        engine = TrainEngine(self.config(kind, "bf16"))
        gen = torch.Generator().manual_seed(3)
        seqs = [
            TrainSequence(torch.randint(3, 64, (12,), generator=gen).tolist(), [5, 6, 7]) for _ in range(8)
        ]
        batches = build_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batches=1, pad_id=0)
        micro = add_global_normalisers([_to(b, self.device) for b in batches])
        engine.train_step(micro, sft_loss)
        offload = TrainerOffload(engine.model, engine.optimizer)
        before = [t.detach().clone() for t in _trainer_state(engine)]
        _sync(self.device)
        allocated = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        start = time.perf_counter()
        moved = offload.offload()
        _sync(self.device)
        seconds = time.perf_counter() - start
        pinned = _saved_copies_pinned(offload)
        if pinned != (self.device.type == "cuda"):
            raise AssertionError(
                f"offloaded copies pinned: {pinned}, expected on {self.device.type} only for CUDA"
            )
        freed = allocated - torch.cuda.memory_allocated() if self.device.type == "cuda" else moved
        if freed < 0.9 * moved:
            raise AssertionError(
                f"offload moved {moved / 2**20:.1f} MiB but the allocator freed {freed / 2**20:.1f}"
            )
        offload.onload()
        after = _trainer_state(engine)
        if not all(torch.equal(a, b) for a, b in zip(before, after)):
            raise AssertionError("parameters or optimizer state changed across offload and onload")
        step = engine.train_step(micro, sft_loss)
        if not torch.isfinite(torch.tensor(step.loss)):
            raise AssertionError(f"the step after onload is not finite: {step.loss}")
        where = "pinned" if pinned else "pageable"
        return (
            f"{moved / 2**20:.1f} MiB moved to {where} CPU memory in {seconds * 1e3:.1f} ms, "
            f"{freed / 2**20:.1f} MiB freed; state bitwise equal after onload"
        )

    def cp_partition(self) -> str:
        """Context parallelism's chunks (sapo_megatron/megatron/context_parallel.py) against Transformer Engine's
        own THD partition (``thd_get_partitioned_indices``, what Megatron uses for THD + CP): cp 2 and 4, packed
        slots of several lengths. CP itself needs >= 2 GPUs (docs/context_parallel.md)."""
        if not have("transformer_engine"):
            raise SkipCheck("the THD partition is Transformer Engine's, which is not installed")
        import transformer_engine_torch as tex

        from sapo_megatron.megatron.context_parallel import segment_chunk_indices

        checked = 0
        for cp in (2, 4):
            bounds = [0, *torch.tensor([4, 2, 6, 2]).mul(cp).cumsum(0).tolist()]
            cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=self.device)
            for rank in range(cp):
                theirs = tex.thd_get_partitioned_indices(cu_seqlens, bounds[-1], cp, rank).cpu().long()
                ours = segment_chunk_indices(bounds, cp, rank)
                if not torch.equal(theirs, ours):
                    raise AssertionError(f"cp {cp} rank {rank}: TE {theirs.tolist()} vs ours {ours.tolist()}")
                checked += 1
        return f"{checked} (cp, rank) partitions equal TE's thd_get_partitioned_indices"

    def cp_rope(self) -> str:
        """Megatron's THD RoPE under CP (the TE path: chunks r and 2·cp−1−r of each slot) equals RoPE at each
        token's own position (the CPU stand-in's), on this device, cp 2 and 4."""
        from megatron.core.models.common.embeddings.rope_utils import (
            _apply_rotary_pos_emb_bshd,
            _apply_rotary_pos_emb_thd,
        )
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        from sapo_megatron.megatron.context_parallel import token_shards

        worst = 0.0
        for cp in (2, 4):
            lengths = [4 * cp, 2 * cp, 6 * cp]
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            batch = {"input_ids": positions, "segment_ids": positions, "position_ids": positions}
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            rope = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, use_cpu_initialization=True)
            freqs = rope.get_emb(max(lengths)).to(self.device)
            for rank in range(cp):
                local = token_shards(batch, cp, rank).local
                t = torch.randn(len(local), 4, 64, device=self.device)
                group = _CpGroup(cp, rank)
                theirs = _apply_rotary_pos_emb_thd(t, cu.to(self.device), freqs, cp_group=group)
                ours = _apply_rotary_pos_emb_bshd(t[:, None], freqs[positions[0, local].to(self.device)])[
                    :, 0
                ]
                worst = max(worst, float((theirs - ours).abs().max()))
        if worst > 1e-6:
            raise AssertionError(f"THD RoPE under CP differs from RoPE at global positions by {worst:.3g}")
        return f"max |Δ| {worst:.2e} over cp 2 and 4, every rank"

    def packing_thd(self, kind: str) -> str:
        """The packed row through TE's THD attention (the engine takes TE whenever it imports)."""
        if not have("transformer_engine"):
            raise SkipCheck("THD packing runs through Transformer Engine's attention, which is not installed")
        return self.packing(kind)

    def packing(self, kind: str) -> str:
        """Packed micro-batches (THD through TE's attention when TE imports, else the block mask) against padded
        ones: per-sequence log-probs of one forward-only pass, and its time per layout (run once per kind)."""
        if kind not in self.packing_runs:
            self.packing_runs[kind] = self._packing(kind)
        return self.packing_runs[kind]

    def _packing(self, kind: str) -> str:
        from sapo_megatron.megatron.loss_hook import LogprobOutput
        from sapo_megatron.megatron.train_step import TrainEngine
        from sapo_megatron.model.batching import SEQUENCE_INDEX, TrainSequence, build_micro_batches
        from sapo_megatron.model.packing import SequenceView

        dtype = "bf16" if have("transformer_engine") else "fp32"  # TE's THD kernels are fp16/bf16 ones
        engine = TrainEngine(self.config(kind, dtype))
        gen = torch.Generator().manual_seed(2)
        lengths = [(int(p), int(r)) for p, r in torch.randint(2, 40, (16, 2), generator=gen)]
        seqs = [
            TrainSequence(
                torch.randint(3, 64, (p,), generator=gen).tolist(),
                torch.randint(3, 64, (r,), generator=gen).tolist(),
            )
            for p, r in lengths
        ]
        logp, ms = {}, {}
        for name, budget in (("padded", None), ("packed", 128)):
            micro = [
                _to(b, self.device)
                for b in build_micro_batches(
                    seqs, dp_rank=0, dp_size=1, micro_batches=2, pad_id=0, max_tokens_per_micro_batch=budget
                )
            ]
            engine.forward_only(micro, LogprobOutput())  # warm-up
            _sync(self.device)
            start = time.perf_counter()
            outputs = engine.forward_only(micro, LogprobOutput())
            _sync(self.device)
            ms[name] = (time.perf_counter() - start) * 1e3
            for batch, value in zip(micro, outputs):
                view = SequenceView(batch)
                rows, mask = view(value), view(batch["loss_mask"]).bool()
                for row, index in enumerate(batch[SEQUENCE_INDEX].tolist()):
                    logp.setdefault(index, {})[name] = rows[row][mask[row]].float()
        diff = max(float((v["padded"] - v["packed"]).abs().max()) for v in logp.values())
        tolerance = 5e-2 if dtype == "bf16" else 1e-5
        if diff > tolerance:
            raise AssertionError(f"packed vs padded max |Δlogp| {diff:.3g} > {tolerance} ({dtype})")
        path = "THD (TE)" if have("transformer_engine") else "block mask (local spec)"
        return (
            f"{path}, {dtype}: max |Δlogp| {diff:.2e} (tolerance {tolerance}); forward-only "
            f"{ms['padded']:.1f} ms padded, {ms['packed']:.1f} ms packed"
        )

    def logprob_memory(self) -> str:
        from sapo_megatron.megatron.logprobs import vocab_parallel_logprobs

        if self.device.type != "cuda":
            return self._logprob_values_cpu()
        tokens, vocab = 4096, 151_936
        logits = torch.randn(tokens, vocab, device=self.device, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,), device=self.device)

        def peak(fn) -> tuple[float, torch.Tensor]:
            logits.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fn()
            out.sum().backward()
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - base) / 2**20, out.detach()

        def naive():
            logp_all = torch.log_softmax(logits.float(), dim=-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            return logp_all.gather(-1, labels[:, None]).squeeze(-1) + 0 * entropy

        naive_mb, ref = peak(naive)
        chunked_mb, got = peak(
            lambda: vocab_parallel_logprobs(logits, labels, tp_group=None, with_entropy=True)[0]
        )
        diff = (ref - got).abs().max().item()
        if chunked_mb > 0.25 * naive_mb or diff > 1e-3:
            raise AssertionError(f"peak {chunked_mb:.0f} MiB vs naive {naive_mb:.0f} MiB, max |Δ| {diff:.2e}")
        return f"peak extra {chunked_mb:.0f} MiB vs naive {naive_mb:.0f} MiB ({chunked_mb / naive_mb:.2f}x), max |Δ| {diff:.1e}"

    def _logprob_values_cpu(self) -> str:
        """The CPU form of the row: values and gradients of the chunked kernel against log_softmax on a small
        vocabulary (memory needs the CUDA allocator)."""
        from sapo_megatron.megatron.logprobs import vocab_parallel_logprobs

        gen = torch.Generator().manual_seed(4)
        logits = torch.randn(256, 4096, generator=gen, dtype=torch.float32).requires_grad_(True)
        labels = torch.randint(0, 4096, (256,), generator=gen)
        got = vocab_parallel_logprobs(logits, labels, tp_group=None, with_entropy=True, chunk_tokens=64)[0]
        (grad_got,) = torch.autograd.grad(got.sum(), logits)
        ref = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        (grad_ref,) = torch.autograd.grad(ref.sum(), logits)
        diff = max((ref - got).abs().max().item(), (grad_ref - grad_got).abs().max().item())
        if diff > 1e-5:
            raise AssertionError(f"max |Δ| of log-probs or gradients {diff:.2e} > 1e-05")
        return f"CPU: values and gradients only (memory needs the CUDA allocator), max |Δ| {diff:.1e}"

    # -- FP8 recipes against bf16 ------------------------------------------------------------------------

    def fp8_config(self, precision: dict):
        """A Qwen3-MoE shape whose GEMM dimensions are multiples of 32 (MXFP8 blocks), same weights every time."""
        from sapo_megatron.config import config_from_dict
        from sapo_megatron.model.tiny import make_tiny_hf_checkpoint

        if "fp8" not in self.hf_dirs:
            self.hf_dirs["fp8"] = make_tiny_hf_checkpoint(self.workdir / "fp8", "moe", seed=0, **FP8_SHAPE)
        hf_dir = str(self.hf_dirs["fp8"])
        return config_from_dict(
            {
                # grouped expert GEMMs with TE (they pad each expert's tokens to the FP8 multiple), as on clusters
                "model": {
                    "hf_config": hf_dir,
                    "init": "hf",
                    "init_path": hf_dir,
                    "moe_grouped_gemm": have("transformer_engine"),
                },
                "precision": precision,
                "optimizer": {"lr": 1e-4},
            }
        )

    def recipe_run(self, recipe: str | None) -> dict:
        """Logits, first loss and median step time of the SFT step under ``recipe`` (None: bf16), cached."""
        from sapo_megatron.config import sequence_length_multiple
        from sapo_megatron.megatron.loss_hook import add_global_normalisers
        from sapo_megatron.megatron.sft import sft_loss
        from sapo_megatron.megatron.train_step import TrainEngine
        from sapo_megatron.model.batching import TrainSequence, build_micro_batches

        if recipe in self.recipe_runs:
            return self.recipe_runs[recipe]
        precision = {"dtype": "bf16"} if recipe is None else {"dtype": "fp8", "fp8_recipe": recipe}
        cfg = self.fp8_config(precision)
        engine = TrainEngine(cfg)
        gen = torch.Generator().manual_seed(2)
        seqs = [
            TrainSequence(
                torch.randint(3, 1000, (40,), generator=gen).tolist(),
                torch.randint(3, 1000, (200,), generator=gen).tolist(),
            )
            for _ in range(8)
        ]
        micro = add_global_normalisers(
            [
                _to(b, self.device)
                for b in build_micro_batches(
                    seqs,
                    dp_rank=0,
                    dp_size=1,
                    micro_batches=2,
                    pad_id=0,
                    length_multiple=sequence_length_multiple(cfg),
                )
            ]
        )
        logits = engine.forward_only(micro, lambda out, batch: out.float())
        times, losses = [], []
        for _ in range(6):
            _sync(self.device)
            start = time.perf_counter()
            losses.append(engine.train_step(micro, sft_loss).loss)
            _sync(self.device)
            times.append(time.perf_counter() - start)
        run = {
            "logits": torch.cat([x.flatten() for x in logits]),
            "loss": losses[0],
            "step_s": sorted(times[1:])[2],
        }
        self.recipe_runs[recipe] = run
        return run

    def fp8_recipe(self, recipe: str) -> str:
        from sapo_megatron.model.precision import fp8_runtime_problem

        problem = fp8_runtime_problem(recipe)
        if problem:
            raise SkipCheck(problem)
        ref, got = self.recipe_run(None), self.recipe_run(recipe)
        logit_err = ((got["logits"] - ref["logits"]).norm() / ref["logits"].norm()).item()
        loss_err = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
        detail = (
            f"loss {got['loss']:.4f} vs bf16 {ref['loss']:.4f} (rel {loss_err:.1e}), logits rel RMS error "
            f"{logit_err:.3f}; step {got['step_s'] * 1e3:.1f} ms vs bf16 {ref['step_s'] * 1e3:.1f} ms "
            f"({got['step_s'] / ref['step_s']:.2f}x)"
        )
        if not (loss_err < FP8_LOSS_TOLERANCE and logit_err < FP8_LOGIT_TOLERANCE):
            raise AssertionError(
                f"{detail}; tolerances: loss {FP8_LOSS_TOLERANCE}, logits {FP8_LOGIT_TOLERANCE}"
            )
        return detail

    # -- which fused kernels Megatron picked --------------------------------------------------------------

    def fused_paths(self) -> str:
        import megatron.core.models.backends as backends
        import megatron.core.optimizer as mc_optimizer
        import megatron.core.optimizer.optimizer as mc_optimizer_impl

        te = f"transformer_engine {_version('transformer_engine')}" if have("transformer_engine") else "no TE"
        spec = "TE layer spec" if have("transformer_engine") else "local spec (pure torch)"
        apex = "apex" if have("apex") else "no apex"
        norm = backends.LNImpl.__name__ + (
            " (apex)" if getattr(backends, "HAVE_APEX", False) else " (torch fallback)"
        )
        adam = f"{mc_optimizer.Adam.__module__}.{mc_optimizer.Adam.__name__}"
        applier = mc_optimizer_impl.multi_tensor_applier
        applier = (
            getattr(applier, "__module__", "") + "." + getattr(applier, "__name__", type(applier).__name__)
        )
        flash = "flash_attn" if have("flash_attn") else "no flash_attn"
        return f"{te}, {apex}, {flash}; {spec}; local-spec norm {norm}; Adam {adam}; multi_tensor_applier {applier}"

    # -- the planner against the allocator ----------------------------------------------------------------

    def planner_activations(self) -> str:
        from sapo_megatron.megatron.activation_probe import measure_activations
        from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
        from sapo_megatron.plan.activations import MicroBatchShape, stage_activations

        cfg = self.fp8_config({"dtype": "bf16"})
        spec = "te" if have("transformer_engine") else "local"
        model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision)).to(self.device)
        batch, seq = (2, 512) if self.device.type == "cuda" else (1, 64)  # the CPU profiler is slow
        ids = torch.randint(
            0, cfg.model.arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3)
        )
        measured = measure_activations(model, ids.to(self.device))
        est = stage_activations(
            cfg, MicroBatchShape(batch, seq), 0, (0, cfg.model.arch.num_hidden_layers), spec=spec
        )
        kept_ratio = est.per_micro_batch / measured.saved
        peak_ratio = (est.per_micro_batch + est.transient) / measured.peak
        detail = (
            f"{spec} spec, {batch}x{seq} tokens: kept {measured.saved / 2**20:.1f} MiB (planner {kept_ratio:.3f}x), "
            f"allocator peak {measured.peak / 2**20:.1f} MiB (planner {peak_ratio:.3f}x)"
        )
        if spec == "local" and abs(kept_ratio - 1) > 0.05:  # the local-spec terms are exact on CPU
            raise AssertionError(detail)
        return detail


FP8_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1024,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
)
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_LOSS_TOLERANCE = 0.02  # relative, first SFT loss (random weights: ln(vocab) ≈ 6.9)
FP8_LOGIT_TOLERANCE = 0.15  # relative RMS error of the logits; e4m3 carries 3 mantissa bits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return "?"


def _trainer_state(engine) -> list[torch.Tensor]:
    """Parameters, then every optimizer state tensor and main parameter (ChainedOptimizer included)."""
    state = [p for p in engine.module.parameters()]
    for wrapped in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = wrapped.optimizer
        state += [p for group in inner.param_groups for p in group["params"]]
        state += [v for entry in inner.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    return state


def _saved_copies_pinned(offload) -> bool:
    """Whether every CPU copy an offload made is in pinned memory (reads TrainerOffload's per-part entries)."""
    saved = [e.saved for part in offload._parts.values() for e in part.values() if e.saved is not None]
    if not saved:
        raise AssertionError("the offload kept no CPU copy")
    return all(t.is_pinned() for t in saved)


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}
