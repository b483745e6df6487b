"""One batch of rows through the CPU engine's model: prefill, then sample and feed one token per step with a KV
cache, pausing between steps (:mod:`.pause`).

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
    from sapo_megatron.rollout.cpu.pause import PauseGate

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

    @property
    def sequence(self) -> list[int]:
        return self.spec.prompt_ids + self.outputs

    def fed_rows(self) -> int:
        return sum(len(r) for r in self.routes)


class BatchDecode:
    """Runs rows (at most the engine's batch size) to completion; the engine's locks are held by the caller."""

    def __init__(self, engine: DecodingEngine, rows: list[RowSpec], seeds: list[int], unlocked: Any) -> None:
        self.engine = engine
        self.unlocked = unlocked
        self.capture = engine._routers is not None and any(r.return_routed_experts for r in rows)
        self.rows = [
            _Row(
                spec=r,
                generator=torch.Generator().manual_seed(s),
                stop_set=set(r.sampling.stop_token_ids)
                | (set() if r.ignore_eos else set(engine.eos_token_ids)),
                done=r.sampling.max_new_tokens == 0,
            )
            for r, s in zip(rows, seeds)
        ]
        self._cache: Any = None

    @torch.no_grad()
    def run(self) -> list[RowResult]:
        gate = self.engine.pause_gate
        routers = self.engine._routers
        if routers is not None:
            routers.enabled = self.capture
        try:
            with gate.decoding():
                batch = self.rows
                next_logits, cache, mask, last_pos, version = self._prefill(batch, first=True)
                while not all(r.done for r in batch):
                    tokens = self._step(batch, next_logits, version)
                    if all(r.done for r in batch):
                        break  # the final tokens are never fed back, as in SGLang
                    self._cache = cache
                    del cache  # a retract pause frees it (drop_cache) while it waits
                    action = gate.checkpoint(
                        max(len(r.outputs) for r in batch), self._drop_cache, self.unlocked
                    )
                    cache = self._cache
                    if action == "abort":
                        for r in batch:
                            if not r.done:
                                r.done, r.finish = True, "abort"
                        break
                    if action == "retract":
                        batch = [r for r in batch if not r.done]
                        next_logits, cache, mask, last_pos, version = self._prefill(batch, first=False)
                        continue
                    next_logits, mask, last_pos, version = self._feed(batch, tokens, cache, mask, last_pos)
        finally:
            if routers is not None:
                routers.enabled = False
        return [self._result(r) for r in self.rows]

    def _drop_cache(self) -> None:
        self._cache = None

    def _step(self, batch: list[_Row], next_logits: torch.Tensor, version: int) -> torch.Tensor:
        tokens, token_logprobs = self.engine._sample(
            [r.spec for r in batch], next_logits, [r.generator for r in batch], [r.done for r in batch]
        )
        for i, r in enumerate(batch):
            if r.done:
                continue
            token = int(tokens[i])
            r.outputs.append(token)
            r.logprobs.append(float(token_logprobs[i]))
            r.versions.append(version)
            if len(r.outputs) >= r.spec.sampling.max_new_tokens:
                r.done, r.finish = True, "length"
            elif token in r.stop_set:
                r.done, r.finish, r.matched = True, "stop", token
        return tokens

    def _prefill(
        self, batch: list[_Row], *, first: bool
    ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor, int]:
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
        routed = engine._routers.take(len(batch), width) if self.capture and engine._routers else None
        for i, r in enumerate(batch):
            if first and r.spec.logprob_start_len >= 0:
                r.input_logprobs = _input_logprobs(logits[i], r.spec, width)
            if not first:
                r.recomputed += lens[i]
            if routed is not None:  # after a retract, keep the routes paired with earlier log-probs
                rows = routed[i, width - lens[i] :]
                r.routes.append(rows if first else rows[r.fed_rows() :])
        return logits[:, -1, :], cache, mask, last_pos, version

    def _feed(
        self, batch: list[_Row], tokens: torch.Tensor, cache: Any, mask: torch.Tensor, last_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        engine = self.engine
        n = len(batch)
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        last_pos = last_pos + 1
        version = engine.weight_version
        out = engine.model(
            input_ids=tokens.view(n, 1),
            attention_mask=mask,
            position_ids=last_pos.view(n, 1),
            use_cache=True,
            logits_to_keep=1,
            **{engine._cache_kwarg: cache},
        )
        if self.capture and engine._routers is not None:
            step = engine._routers.take(n, 1)
            for i, r in enumerate(batch):
                # A row that finished feeds a filler token: mark it so that it is not taken as routing.
                r.routes.append(np.full_like(step[i], _FILLER) if r.done else step[i])
        return out.logits[:, -1, :].float(), mask, last_pos, version

    def _result(self, r: _Row) -> RowResult:
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
