"""Rows through the CPU engine's model: prefill, then sample and feed one token per step with a KV cache, pausing
between steps (:mod:`.pause`). :class:`Decoder` holds the steps over a :class:`Running` batch; :class:`BatchDecode`
runs one static batch to completion (the in-process engine, the server's ``--static-batches``);
:mod:`.continuous` lets rows join (:meth:`Decoder.merge`) and leave (:meth:`Decoder.select`) between steps.

Every sampled token records the engine's weight version of the forward that produced its logits, and every fed
position the routes of that same forward, so that a request spanning a weight update returns per-token versions,
log-probs and routes paired by forward:

- ``in_place``: the batch keeps its cache; tokens after the update come from the new weights attending to the
  cache of the old ones (as SGLang's in-place pause).
- ``retract``: the cache is dropped; after continue, prompt + output so far are prefilled again with the new
  weights (counted in ``recomputed_tokens``); the routes of positions whose log-probs came before the pause are
  kept, only the last fed token's route (it produces the next token) comes from the new prefill.
- ``abort``: live rows finish now with ``finish_reason="abort"`` and the tokens made so far.

Route row ``p`` pairs with the log-prob of token ``p + 1`` (prompt rows with the first response token's forward).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from sapo_megatron.rollout.types import FinishReason, SamplingParams

if TYPE_CHECKING:
    from sapo_megatron.rollout.cpu.pause import Action, PauseGate

_FILLER = np.iinfo(np.int32).min  # routing of a finished row's filler token


@dataclasses.dataclass
class RowSpec:
    """One sequence to generate (one sample of a request), as the engine sees it.

    ``logprob_start_len``: -1 for no input logprobs, else the first prompt position whose logprob is returned.
    ``images``: PNG bytes of the prompt's images; :meth:`CPUEngine.prepare_images` expands ``prompt_ids`` and
    sets ``pixels`` (``pixel_values``, ``image_grid_thw``).
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int | None = None
    return_routed_experts: bool = False
    logprob_start_len: int = -1
    ignore_eos: bool = False
    routed_experts_start: int = 0  # routes from this position on (SGLang's routed_experts_start_len)
    images: tuple[bytes, ...] = ()
    pixels: dict[str, torch.Tensor] | None = None


class DecodingEngine(Protocol):
    """What a batch needs of :class:`~sapo_megatron.rollout.cpu.engine.CPUEngine`."""

    model: Any
    _routers: Any
    _vision: Any
    _cache_kwarg: str
    eos_token_ids: tuple[int, ...]
    weight_version: int
    pause_gate: PauseGate

    def _sample(
        self, rows: list[RowSpec], logits: torch.Tensor, generators: list, done: list[bool]
    ) -> Any: ...


@dataclasses.dataclass
class RowResult:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    matched_stop: int | None
    # Entries for prompt positions logprob_start_len .. P-1; the entry of position 0 is None.
    input_logprobs: list[float | None] | None
    routed_experts: np.ndarray | None
    token_versions: list[int] = dataclasses.field(
        default_factory=list
    )  # engine weight version per output token
    recomputed_tokens: int = 0  # tokens prefilled again after a retract pause


@dataclasses.dataclass
class _Row:
    spec: RowSpec
    generator: torch.Generator
    stop_set: set[int]
    outputs: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # [n, layers, top_k] per fed chunk
    finish: FinishReason = "length"
    matched: int | None = None
    done: bool = False
    input_logprobs: list[float | None] | None = None
    recomputed: int = 0
    next_version: int = 0  # the weight version of the forward whose logits the row samples next

    @property
    def sequence(self) -> list[int]:
        return self.spec.prompt_ids + self.outputs

    def fed_rows(self) -> int:
        return sum(len(r) for r in self.routes)


@dataclasses.dataclass
class Running:
    """A batch between two decode steps: its rows, their KV cache ``[rows, heads, width, dim]`` per layer (left
    padded), attention mask ``[rows, width]``, each row's last position and the logits of its next token."""

    rows: list[_Row]
    cache: Any
    mask: torch.Tensor
    last_pos: torch.Tensor
    logits: torch.Tensor


class Decoder:
    """The steps of a decode loop over :class:`Running` batches; the engine's locks are held by the caller.

    :class:`BatchDecode` runs one static batch with them; :mod:`.continuous` lets rows join and leave between steps
    (:meth:`select`, :meth:`merge`)."""

    def __init__(self, engine: DecodingEngine, unlocked: Any) -> None:
        self.engine = engine
        self.unlocked = unlocked

    def new_rows(self, specs: list[RowSpec], seeds: list[int]) -> list[_Row]:
        eos = set(self.engine.eos_token_ids)
        return [
            _Row(
                spec=r,
                generator=torch.Generator().manual_seed(s),
                stop_set=set(r.sampling.stop_token_ids) | (set() if r.ignore_eos else eos),
                done=r.sampling.max_new_tokens == 0,
            )
            for r, s in zip(specs, seeds)
        ]

    def _capture(self, rows: list[_Row]) -> bool:
        """Route capture for the next forward: on when a row of it returns routes."""
        routers = self.engine._routers
        capture = routers is not None and any(r.spec.return_routed_experts for r in rows)
        if routers is not None:
            routers.enabled = capture
        return capture

    def sample(self, run: Running) -> torch.Tensor:
        """Sample every live row's next token from ``run.logits``; rows that reach a stop are marked done."""
        batch = run.rows
        tokens, token_logprobs = self.engine._sample(
            [r.spec for r in batch], run.logits, [r.generator for r in batch], [r.done for r in batch]
        )
        for i, r in enumerate(batch):
            if r.done:
                continue
            token = int(tokens[i])
            r.outputs.append(token)
            r.logprobs.append(float(token_logprobs[i]))
            r.versions.append(r.next_version)
            # SGLang 0.5.23 Req.update_finish_state: a stop token beats the length cap
            if token in r.stop_set:
                r.done, r.finish, r.matched = True, "stop", token
            elif len(r.outputs) >= r.spec.sampling.max_new_tokens:
                r.done, r.finish = True, "length"
        return tokens

    def checkpoint(self, run: Running) -> Action:
        """The pause check between sampling and feeding (:meth:`PauseGate.checkpoint`); a retract pause frees
        ``run.cache`` while it waits."""

        def drop_cache() -> None:
            run.cache = None

        tokens = max(len(r.outputs) for r in run.rows)
        return self.engine.pause_gate.checkpoint(tokens, drop_cache, self.unlocked)

    def prefill(self, batch: list[_Row], *, first: bool) -> Running:
        """Feed each row's prompt + output so far (left padded); the first prefill also gives input logprobs."""
        engine = self.engine
        seqs = [r.sequence for r in batch]
        lens = [len(s) for s in seqs]
        width = max(lens)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, seq in enumerate(seqs):  # left padding keeps every row's next token in the last column
            input_ids[i, width - lens[i] :] = torch.tensor(seq)
            mask[i, width - lens[i] :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        last_pos = position_ids[:, -1]
        extra: dict[str, torch.Tensor] = {}
        if engine._vision is not None:  # 3-D MRoPE positions, the images' pixels
            specs = [r.spec for r in batch]
            grids = [s.pixels["image_grid_thw"] for s in specs if s.pixels is not None]
            if grids:
                extra["pixel_values"] = torch.cat([s.pixels["pixel_values"] for s in specs if s.pixels])
                extra["image_grid_thw"] = torch.cat(grids)
            position_ids, last_pos = engine._vision.positions(input_ids, mask, extra.get("image_grid_thw"))
            extra["mm_token_type_ids"] = engine._vision.mm_token_type_ids(input_ids, mask)
        want_input = first and any(r.spec.logprob_start_len >= 0 for r in batch)
        capture = self._capture(batch)
        version = engine.weight_version
        cache = _new_cache()
        out = engine.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=0 if want_input else 1,
            **{engine._cache_kwarg: cache},
            **extra,
        )
        logits = out.logits.float()
        routed = engine._routers.take(len(batch), width) if capture and engine._routers else None
        for i, r in enumerate(batch):
            r.next_version = version
            if first and r.spec.logprob_start_len >= 0:
                r.input_logprobs = _input_logprobs(logits[i], r.spec, width)
            if not first:
                r.recomputed += lens[i]
            if routed is not None:  # after a retract, keep the routes paired with earlier log-probs
                rows = routed[i, width - lens[i] :]
                r.routes.append(rows if first else rows[r.fed_rows() :])
        return Running(batch, cache, mask, last_pos, logits[:, -1, :])

    def feed(self, run: Running, tokens: torch.Tensor) -> None:
        """Feed every row's sampled token (a finished row's is a filler); ``run`` then holds the next logits."""
        engine = self.engine
        batch = run.rows
        n = len(batch)
        run.mask = torch.cat([run.mask, torch.ones((n, 1), dtype=run.mask.dtype)], dim=1)
        run.last_pos = run.last_pos + 1
        capture = self._capture(batch)
        version = engine.weight_version
        out = engine.model(
            input_ids=tokens.view(n, 1),
            attention_mask=run.mask,
            position_ids=run.last_pos.view(n, 1),
            use_cache=True,
            logits_to_keep=1,
            **{engine._cache_kwarg: run.cache},
        )
        step = engine._routers.take(n, 1) if capture and engine._routers is not None else None
        for i, r in enumerate(batch):
            r.next_version = version
            if step is not None:
                # A row that finished feeds a filler token: mark it so that it is not taken as routing.
                r.routes.append(np.full_like(step[i], _FILLER) if r.done else step[i])
        run.logits = out.logits[:, -1, :].float()

    @staticmethod
    def select(run: Running, keep: list[int]) -> None:
        """Keep rows ``keep`` of ``run`` (cache, mask, positions, logits on the batch dim), then cut the columns
        that are padding for every kept row."""
        index = torch.tensor(keep, dtype=torch.long)
        run.rows = [run.rows[i] for i in keep]
        run.mask, run.last_pos, run.logits = run.mask[index], run.last_pos[index], run.logits[index]
        cut = int(run.mask.any(dim=0).long().argmax()) if keep else 0
        run.mask = run.mask[:, cut:]
        for layer in _layers(run.cache):
            layer.keys, layer.values = layer.keys[index, :, cut:], layer.values[index, :, cut:]

    @staticmethod
    def merge(run: Running, other: Running) -> None:
        """Append ``other``'s rows to ``run``: masks and caches left padded to a common width (positions are
        per row, so padding changes none)."""
        width = max(run.mask.shape[1], other.mask.shape[1])
        run.rows = run.rows + other.rows
        run.mask = torch.cat([_left_pad(run.mask, width, 1), _left_pad(other.mask, width, 1)])
        run.last_pos = torch.cat([run.last_pos, other.last_pos])
        run.logits = torch.cat([run.logits, other.logits])
        for mine, theirs in zip(_layers(run.cache), _layers(other.cache), strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])

    @staticmethod
    def result(r: _Row) -> RowResult:
        routed = None
        if r.spec.return_routed_experts:
            n_rows = len(r.spec.prompt_ids) + len(r.outputs) - 1
            routed = np.concatenate(r.routes, axis=0)[:n_rows]
            if (routed == _FILLER).any():
                raise AssertionError("routing of a finished row leaked into its routed_experts")
            routed = np.ascontiguousarray(routed[r.spec.routed_experts_start :], dtype=np.int32)
        return RowResult(
            output_ids=r.outputs,
            output_logprobs=r.logprobs,
            finish_reason=r.finish,
            matched_stop=r.matched,
            input_logprobs=r.input_logprobs,
            routed_experts=routed,
            token_versions=r.versions,
            recomputed_tokens=r.recomputed,
        )


class BatchDecode:
    """Runs rows (at most the engine's batch size) to completion as one static batch: a row that finishes feeds
    fillers until the last one does; the engine's locks are held by the caller."""

    def __init__(self, engine: DecodingEngine, rows: list[RowSpec], seeds: list[int], unlocked: Any) -> None:
        self.decoder = Decoder(engine, unlocked)
        self.rows = self.decoder.new_rows(rows, seeds)

    @torch.no_grad()
    def run(self) -> list[RowResult]:
        engine, decoder = self.decoder.engine, self.decoder
        try:
            with engine.pause_gate.decoding():
                run = decoder.prefill(self.rows, first=True)
                while not all(r.done for r in run.rows):
                    tokens = decoder.sample(run)
                    if all(r.done for r in run.rows):
                        break  # the final tokens are never fed back, as in SGLang
                    action = decoder.checkpoint(run)
                    if action == "abort":
                        abort_live(run.rows)
                        break
                    if action == "retract":
                        run = decoder.prefill([r for r in run.rows if not r.done], first=False)
                        continue
                    decoder.feed(run, tokens)
        finally:
            if engine._routers is not None:
                engine._routers.enabled = False
        return [decoder.result(r) for r in self.rows]


def abort_live(rows: list[_Row]) -> None:
    """An abort pause: live rows finish now with the tokens made so far."""
    for r in rows:
        if not r.done:
            r.done, r.finish = True, "abort"


def _layers(cache: Any) -> list[Any]:
    """The per-layer key/value holders of a transformers ``DynamicCache`` (``.layers[i].keys`` / ``.values``)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError(
            f"continuous batching needs transformers' DynamicCache with .layers (transformers >= 4.56), got "
            f"{type(cache).__name__}; run the server with --static-batches"
        )
    return list(layers)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def _input_logprobs(logits_sv: torch.Tensor, row: RowSpec, width: int) -> list[float | None]:
    """log p(ids[t] | ids[:t]) for t >= logprob_start_len, from one row's prefill logits [width, vocab]."""
    length = len(row.prompt_ids)
    row_logits = logits_sv[width - length :]
    ids = torch.tensor(row.prompt_ids)
    values = torch.log_softmax(row_logits[:-1], dim=-1).gather(1, ids[1:, None]).squeeze(1).tolist()
    full: list[float | None] = [None, *values]
    return full[row.logprob_start_len :]
