"""A rollout engine on transformers (Qwen3 / Qwen3-MoE causal LMs) for CPUs: development, tests, embedded demo.

It reproduces what the trainer relies on from SGLang, so that swapping engines changes speed, not semantics:

- **Sampling** (SGLang's torch fallback sampler): logits / temperature -> softmax -> top-k and top-p masks on the
  sorted probabilities (top-p judged on the unfiltered cumulative mass) -> multinomial. ``temperature < 1e-6`` or
  ``top_k == 1`` is greedy (argmax of the raw logits).
- **Output logprobs** (SGLang ``layers/sampler.py``): the log-probability of the sampled token under the
  temperature-scaled, *unfiltered* distribution, ``log_softmax(logits / T)`` over the whole vocabulary; greedy rows
  use ``T = 1``. With ``return_original_logprob=True`` (SGLang's env ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``) it is
  ``log_softmax(logits)`` whatever the temperature. At ``T = 1`` both are the trainer's log-probability.
- **Input logprobs** (teacher scoring, ``logprob_start_len >= 0``): ``log_softmax(logits)`` at temperature 1, the
  first token's entry None.
- **Stopping** (SGLang 0.5.23 ``Req.update_finish_state``): the stop token ids and the model's EOS ids are checked
  first ("stop"; the stop token is part of the output), then ``max_new_tokens`` ("length") – a stop token sampled
  as the last allowed token is a "stop", not a truncation.
- **Precision** (:mod:`sapo_megatron.rollout.precision`): ``fp32`` (default; equals the trainer), ``bf16``
  (``--dtype bfloat16``) or ``fp8`` (SGLang's block-wise W8A8 fp8 on the decoder's linear layers), applied at
  load and re-applied to every weight update; logits are upcast to fp32 before any softmax.
- **Routed experts**: each MoE layer's router top-k indices (in ``torch.topk`` order, descending router
  probability) for every token fed to the model: int32 ``[len(prompt) + len(output) - 1, num_hidden_layers, top_k]``
  like SGLang's ``--enable-return-routed-experts``. Layers without a router (dense layers of mixed models) hold -1.

- **Images** (Qwen3-VL models, :mod:`sapo_megatron.rollout.cpu.vision`): a request's images (PNG) go through the
  model's image processor; its prompt's image pads are expanded to the processor's grid (the expanded length is
  the reported prompt length) and the 3-D MRoPE positions come from the model's ``get_rope_index``.

Prompts x samples run as one left-padded batch with a KV cache. Each row samples from its own ``torch.Generator``
(seeded from the request's ``sampling_seed``, or drawn from the engine seed in row order), so results do not depend
on how rows were batched.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from sapo_megatron.rollout.base import (  # ContextLengthError: also importable from here, as before
    ContextLengthError,
    RolloutEngine,
    RolloutError,
    normalize_response_starts,
)
from sapo_megatron.rollout.cpu.decode import BatchDecode, RowResult, RowSpec  # re-exported
from sapo_megatron.rollout.cpu.pause import PausableEngine, PauseGate
from sapo_megatron.rollout.cpu.vision import EngineVision, is_vision_model
from sapo_megatron.rollout.partial import already_ended, continuation_request, splice
from sapo_megatron.rollout.precision import EngineNumerics
from sapo_megatron.rollout.types import (
    GenerationRequest,
    ImageInputs,
    Sample,
    SamplingParams,
    mask_image_targets,
)

logger = logging.getLogger(__name__)

# torch already spreads one forward over every core; two engines of one process computing at once only fight over
# them (OpenMP threads spinning against each other), so forwards of all engines take turns.
_COMPUTE_LOCK = threading.Lock()

_EXPERT_WEIGHT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


class _RouterCapture:
    """Forward hooks on every MoE router that keep the top-k expert indices of the current forward."""

    def __init__(self, model: PreTrainedModel, top_k: int) -> None:
        self.top_k = top_k
        self.enabled = False
        self.layer_ids: list[int] = []
        self.captured: dict[int, torch.Tensor] = {}
        self._handles = []
        layers = model.get_decoder().layers
        for layer_id, layer in enumerate(layers):
            mlp = getattr(layer, "mlp", None)
            router = getattr(mlp, "gate", None)
            if router is None or not hasattr(mlp, "experts"):
                continue
            self.layer_ids.append(layer_id)
            self._handles.append(router.register_forward_hook(self._hook(layer_id)))
        self.num_layers = len(layers)

    def _hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if not self.enabled:
                return
            if isinstance(output, tuple):  # transformers >= 5: (router_logits, router_scores, router_indices)
                indices = output[-1]
            else:  # older transformers: the gate is a Linear returning router logits
                probs = torch.softmax(output, dim=-1, dtype=torch.float)
                indices = torch.topk(probs, self.top_k, dim=-1).indices
            self.captured[layer_id] = indices.detach().reshape(-1, self.top_k).to(torch.int32)

        return hook

    def take(self, batch: int, seq: int) -> np.ndarray:
        """What the last forward routed: int32 [batch, seq, num_hidden_layers, top_k] (-1 where no router)."""
        out = np.full((batch, seq, self.num_layers, self.top_k), -1, dtype=np.int32)
        for layer_id in self.layer_ids:
            out[:, :, layer_id, :] = self.captured[layer_id].reshape(batch, seq, self.top_k).numpy()
        self.captured.clear()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class CPUEngine(PausableEngine, RolloutEngine):
    """In-process rollout engine around a transformers causal LM. Thread-safe; calls run one at a time.

    ``num_threads`` sets torch's intra-op threads for the engine's forwards (and restores them after): tiny models
    run as fast on one thread, and one thread does not collapse when other processes load the cores, which
    OpenMP's spinning threads do. None keeps torch's setting.

    ``precision`` (``fp32``, ``bf16``, ``fp8``): the engine's numerics (see :mod:`~sapo_megatron.rollout.precision`).
    The engine takes ownership of ``model``: it casts (and for fp8 quantises) its parameters in place.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        model_path: str | None = None,
        seed: int = 0,
        max_batch_size: int = 64,
        return_original_logprob: bool = False,
        num_threads: int | None = None,
        precision: str = "fp32",
        image_processor: object | None = None,
    ) -> None:
        self.numerics = EngineNumerics(precision)
        self.model = model.eval().requires_grad_(False)
        self.numerics.install(self.model)
        self.num_threads = num_threads
        self.model_path = model_path
        self.max_batch_size = max_batch_size
        self.return_original_logprob = return_original_logprob
        self.weight_version = 0
        config = model.config.get_text_config()  # a VL model's language model holds these
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.num_experts = int(getattr(config, "num_experts", 0) or 0)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.eos_token_ids = _eos_ids(model)
        self._routers = _RouterCapture(model, self.top_k) if self.num_experts and self.top_k else None
        self._vision = EngineVision(model, image_processor) if is_vision_model(model) else None
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.seed = seed
        self._seed_rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self.pause_gate = PauseGate()
        self._closed = False
        self._counters = {
            "rollout/samples": 0.0,
            "rollout/generated_tokens": 0.0,
            "rollout/partial_samples": 0.0,
        }

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs) -> CPUEngine:
        """Load an HF checkpoint directory (config.json + safetensors) in float32, then apply ``precision``; a VL
        model's image processor comes from the directory's ``preprocessor_config.json``."""
        from sapo_megatron.data.vision import load_image_processor

        model = _load_model(model_dir)
        if is_vision_model(model):
            kwargs.setdefault("image_processor", load_image_processor(model_dir))
        return cls(model, model_path=str(model_dir), **kwargs)

    # ------------------------------------------------------------------ facts
    @property
    def precision(self) -> str:
        return self.numerics.precision

    @property
    def is_moe(self) -> bool:
        return self._routers is not None

    @property
    def num_layers(self) -> int:
        return int(self.model.config.get_text_config().num_hidden_layers)

    @property
    def takes_images(self) -> bool:
        return self._vision is not None

    def model_info(self) -> dict[str, object]:
        return {
            "model_path": self.model_path,
            "architectures": list(
                getattr(self.model.config, "architectures", None) or [type(self.model).__name__]
            ),
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_layers,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "weight_version": self.weight_version,
        }

    # ------------------------------------------------------------------ RolloutEngine
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        rows = [
            RowSpec(
                prompt_ids=list(req.prompt_ids),
                sampling=req.sampling,
                seed=req.sampling.seed_for(index),
                return_routed_experts=req.return_routed_experts,
                routed_experts_start=req.routed_experts_start,
                images=req.images.png if req.images is not None else (),
            )
            for req in requests
            for index in range(req.n)
        ]
        for req, row in zip((r for r in requests for _ in range(r.n)), rows):
            self._check_prompt(req, row)
        start = self.weight_version  # the version an aborted sample's partial was made with
        epoch = self.pause_gate.abort_epoch
        results = iter(self.generate_rows(rows))
        samples: list[list[Sample]] = []
        for req in requests:
            group = []
            for index in range(req.n):
                res = next(results)
                group.append(
                    Sample(
                        group_id=req.group_id,
                        sample_index=index,
                        prompt_ids=list(req.prompt_ids),
                        response_ids=res.output_ids,
                        rollout_logp=res.output_logprobs,
                        finish_reason=res.finish_reason,
                        routed_experts=res.routed_experts,
                        routed_experts_start=req.routed_experts_start,
                        token_versions=res.token_versions,
                    )
                )
            samples.append([self._continued(req, s, epoch, start) for s in group])
        return samples

    def _continued(self, req: GenerationRequest, sample: Sample, epoch: int, version: int) -> Sample:
        """A sample that an ``abort`` pause cut short, continued after ``continue_generation`` with the weights of
        then (:mod:`sapo_megatron.rollout.partial`), never restarted, as the SGLang client does; a sample that a
        scripted abort (``pause_after``) cut comes back as it is."""
        if sample.finish_reason != "abort" or self.pause_gate.abort_epoch == epoch:
            return sample
        ended = already_ended(req, sample)
        if ended is not None:  # the abort came after its last token: nothing to continue
            return ended
        self.pause_gate.wait_running(None)
        with self._lock:
            self._counters["rollout/partial_samples"] += 1
        now = self.weight_version
        continuation = self.generate([continuation_request(req, sample)])[0][0]
        return splice(sample, continuation, partial_version=version, continuation_version=now)

    def _check_prompt(self, req: GenerationRequest, row: RowSpec) -> None:
        """Expand ``row``'s images with this engine's processor; the prompt must then be the trainer's."""
        if not row.images:
            return
        try:
            self.prepare_images(row)
        except ValueError as exc:
            raise RolloutError(f"group {req.group_id}: {exc}", request=f"g{req.group_id}") from None
        if row.prompt_ids != list(req.prompt_ids):
            raise RolloutError(
                f"group {req.group_id}: the engine's prompt has {len(row.prompt_ids)} tokens after expanding its "
                f"images (grids {row.pixels['image_grid_thw'].tolist() if row.pixels else []}), the trainer's {len(req.prompt_ids)}: "
                "trainer and engine would see different images",
                request=f"g{req.group_id}",
                field="prompt_tokens",
            )

    def prepare_images(self, row: RowSpec) -> None:
        """Expand the image pads of ``row.prompt_ids`` for ``row.images`` and set ``row.pixels`` (ValueError
        for a model without images, an unreadable image, or pads that do not pair with the images)."""
        if self._vision is None:
            raise ValueError("image_data given, but this model takes no images")
        row.prompt_ids, row.pixels = self._vision.prepare(row.prompt_ids, row.images)

    def score(
        self,
        token_ids_list: Sequence[Sequence[int]],
        response_start: int | Sequence[int],
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[float]]:
        starts = normalize_response_starts(token_ids_list, response_start)
        images = list(images) if images is not None else [None] * len(token_ids_list)
        rows = [
            RowSpec(
                prompt_ids=list(ids),
                sampling=SamplingParams(max_new_tokens=0),
                logprob_start_len=0,
                images=image.png if image is not None else (),
            )
            for ids, image in zip(token_ids_list, images)
        ]
        results = self.generate_rows(rows)
        out = []
        for ids, res, start, image in zip(token_ids_list, results, starts, images):
            # input_logprobs[t] is log p(ids[t] | ids[:t]); entry 0 is None.
            logprobs = cast("list[float]", res.input_logprobs)  # asked for (start 0); only entry 0 is None
            values = [float(lp) for lp in logprobs[start:]]
            out.append(mask_image_targets(values, ids[start:], image))
        return out

    def update_weights_from_disk(self, path: str) -> None:
        """Reload weights from an HF directory with the same architecture and shapes (strict), in the engine's
        precision (fp8 weights are quantised again from the checkpoint's values)."""
        new_model = _load_model(path)
        mismatch = _state_mismatch(self.model.state_dict(), new_model.state_dict())
        if mismatch:
            raise ValueError(f"the checkpoint in {path} is not the served model's architecture: {mismatch}")
        with self._lock, torch.no_grad():
            try:
                self.model.load_state_dict(new_model.state_dict(), strict=True)
            except RuntimeError as exc:
                raise ValueError(
                    f"update_weights_from_disk({path}): checkpoint does not fit the served model: {exc}"
                ) from exc
            self.numerics.requantize_(self.model)
            self.model_path = str(path)
            self.weight_version += 1

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the live model; all names and shapes are checked before anything is copied.

        Accepts the model's own parameter names and the per-expert checkpoint names of fused MoE experts
        (``...mlp.experts.{e}.{gate,up,down}_proj.weight``, as on disk and as SGLang loads them). Values take the
        engine's precision: cast to the parameter's dtype, and fp8 weights quantised again.
        """
        named = list(named_tensors)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        resolved = [self._resolve(name, tuple(tensor.shape), params) for name, tensor in named]
        with self._lock, torch.no_grad():
            for (param_name, target), (_, tensor) in zip(resolved, named):
                self.numerics.load_(param_name, target, tensor)
            self.weight_version += 1

    def weight_targets(self, names_and_shapes: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """The live tensors that weights of these HF names and shapes would overwrite (views into fused experts).

        Raises ValueError naming the first unknown name or mismatched shape; changes nothing.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return [self._resolve(name, shape, params)[1] for name, shape in names_and_shapes]

    def _resolve(
        self, name: str, shape: Sequence[int], params: dict[str, torch.nn.Parameter]
    ) -> tuple[str, torch.Tensor]:
        """The model parameter an HF-named weight belongs to, and the live view it overwrites (shape-checked)."""
        param_name, target = self._target_for(name, params)
        if tuple(target.shape) != tuple(shape):
            raise ValueError(f"weight {name} has shape {list(shape)}, the model expects {list(target.shape)}")
        return param_name, target

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Release the compute locks that a decode loop holds while it waits for ``continue_generation``, so that
        weights can be updated meanwhile."""
        _COMPUTE_LOCK.release()
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            _COMPUTE_LOCK.acquire()

    def flush_cache(self) -> None:
        """Nothing to do: every call starts from an empty KV cache (no prefix cache)."""

    def health(self) -> bool:
        return not self._closed

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        self._closed = True
        if self._routers is not None:
            self._routers.remove()

    # ------------------------------------------------------------------ rows
    def validate_row(self, row: RowSpec) -> None:
        """Raise ValueError for a row the model cannot serve (the server answers 400)."""
        if not row.prompt_ids:
            raise ValueError("input_ids is empty")
        bad = [t for t in row.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        total = len(row.prompt_ids) + row.sampling.max_new_tokens
        if total > self.max_context:
            raise ContextLengthError(
                f"requested {len(row.prompt_ids)} prompt + {row.sampling.max_new_tokens} new tokens exceeds the "
                f"model's maximum context length {self.max_context}"
            )
        if row.return_routed_experts and self._routers is None:
            raise ValueError("return_routed_experts needs a MoE model; this model has no routers")
        if row.logprob_start_len >= len(row.prompt_ids):
            raise ValueError(f"logprob_start_len={row.logprob_start_len} is not below the prompt length")

    def generate_rows(self, rows: Sequence[RowSpec]) -> list[RowResult]:
        if self._closed:
            raise RuntimeError("CPUEngine is closed")
        for row in rows:
            if row.images and row.pixels is None:
                self.prepare_images(row)
            self.validate_row(row)
        self.pause_gate.wait_running(None)  # new work waits for continue_generation, as in SGLang
        with self._lock:
            seeds = [r.seed if r.seed is not None else int(self._seed_rng.integers(2**62)) for r in rows]
            results: list[RowResult] = []
            with _COMPUTE_LOCK, _torch_threads(self.num_threads):
                for start in range(0, len(rows), self.max_batch_size):
                    chunk = slice(start, start + self.max_batch_size)
                    results.extend(BatchDecode(self, list(rows[chunk]), seeds[chunk], self._unlocked).run())
            self._counters["rollout/samples"] += len(rows)
            self._counters["rollout/generated_tokens"] += sum(len(r.output_ids) for r in results)
            return results

    def _sample(self, rows, logits, generators, done):
        """Next token and its reported logprob for every row. logits: float32 [batch, vocab]."""
        batch = logits.shape[0]
        greedy = torch.tensor([r.sampling.is_greedy for r in rows])
        temperature = torch.tensor(
            [1.0 if r.sampling.is_greedy else r.sampling.temperature for r in rows], dtype=torch.float32
        )
        scaled = logits / temperature[:, None]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        reported = raw_logprobs if self.return_original_logprob else torch.log_softmax(scaled, dim=-1)

        tokens = torch.argmax(logits, dim=-1)
        if not bool(greedy.all()):
            probs = torch.softmax(scaled, dim=-1)
            probs_sorted, order = probs.sort(dim=-1, descending=True)
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            rank = torch.arange(probs.shape[-1])[None, :]
            top_k = torch.tensor(
                [r.sampling.top_k if r.sampling.top_k > 0 else probs.shape[-1] for r in rows]
            )
            top_p = torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32)
            keep = (rank < top_k[:, None]) & (mass_before <= top_p[:, None])
            probs_sorted = torch.where(keep, probs_sorted, torch.zeros_like(probs_sorted))
            for i in range(batch):
                if greedy[i] or done[i]:
                    continue
                pick = torch.multinomial(probs_sorted[i], 1, generator=generators[i])
                tokens[i] = order[i, pick[0]]
        token_logprobs = reported.gather(1, tokens[:, None]).squeeze(1)
        return tokens, token_logprobs

    def _target_for(self, name: str, params: dict[str, torch.nn.Parameter]) -> tuple[str, torch.Tensor]:
        if name in params:
            return name, params[name].data
        match = _EXPERT_WEIGHT.match(name)
        if match:
            prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
            fused_name = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
            fused = params.get(fused_name)
            if fused is not None and fused.dim() == 3:
                if expert >= fused.shape[0]:
                    raise ValueError(f"weight {name}: expert {expert} >= {fused.shape[0]}")
                if proj == "down_proj":
                    return fused_name, fused.data[expert]
                half = fused.shape[1] // 2  # gate_up_proj is [E, 2F, H]: gate rows first, then up rows
                rows = slice(None, half) if proj == "gate_proj" else slice(half, None)
                return fused_name, fused.data[expert, rows]
        raise ValueError(f"unknown weight name {name!r}")


@contextlib.contextmanager
def _torch_threads(num_threads: int | None):
    if num_threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)  # per OS thread for OpenMP: set in the thread that computes
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _load_model(model_dir: str | Path) -> PreTrainedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    from sapo_megatron.checkpoint.fused_experts import transpose_square_hub_experts
    from sapo_megatron.checkpoint.hf_io import check_safetensors_complete

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an HF checkpoint directory (no config.json)")
    check_safetensors_complete(path)  # a truncated file named, not a bare SafetensorError
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers 5 draws a "Loading weights" bar for a local load
    vision = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    try:  # a hub-layout VL-MoE with H = I (or 2I) loads with experts transformers left untransposed
        return transpose_square_hub_experts(auto.from_pretrained(path, dtype=torch.float32).eval(), path)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


def _eos_ids(model: torch.nn.Module) -> tuple[int, ...]:
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ()


def _state_mismatch(served: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> str | None:
    """The first difference between two state dicts, in a few words (None when names and shapes agree)."""
    missing = sorted(set(served) - set(loaded))
    extra = sorted(set(loaded) - set(served))
    if missing or extra:
        return (
            f"{len(missing)} tensors missing (e.g. {missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})"
        )
    shapes = [
        (n, tuple(loaded[n].shape), tuple(t.shape)) for n, t in served.items() if loaded[n].shape != t.shape
    ]
    if shapes:
        name, got, want = shapes[0]
        return f"{len(shapes)} tensors differ in shape, e.g. {name} is {list(got)}, the served model's {list(want)}"
    return None
