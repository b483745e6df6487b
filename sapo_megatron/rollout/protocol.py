"""The subset of SGLang's native HTTP API that this project speaks, in one place.

Both sides use it: :mod:`sglang_client` builds requests and checks replies, :mod:`cpu_server` builds replies. Field
names follow SGLang's ``GenerateReqInput`` (``python/sglang/srt/managers/io_struct.py``) and the ``meta_info`` that
its tokenizer manager returns:

- request: ``input_ids``, ``sampling_params`` {``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``,
  ``stop_token_ids``, ``skip_special_tokens``, ``no_stop_trim``, ``sampling_seed``}, ``return_logprob``,
  ``logprob_start_len``, ``return_routed_experts``, ``rid``;
- reply: ``text``, ``output_ids``, ``meta_info`` {``id``, ``finish_reason`` ({"type": "stop", "matched": id} |
  {"type": "length", "length": n} | {"type": "abort", "message": ...}), ``prompt_tokens``, ``completion_tokens``,
  ``output_token_logprobs`` / ``input_token_logprobs`` (``[logprob, token_id, text|None]``; the first input entry's
  logprob is None), ``routed_experts`` (base64 of little-endian int32, C order, ``[seq_len - 1, num_layers, top_k]``)}.

Every reply is validated; a reply that cannot be used raises :class:`RolloutError` naming server, request and field.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.types import FINISH_REASONS, FinishReason, SamplingParams

ROUTED_EXPERTS_DTYPE = np.dtype("<i4")


def sampling_params_payload(sampling: SamplingParams, sample_index: int = 0) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        # Token ids are the contract; text is only for humans, so keep it untrimmed and complete.
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    seed = sampling.seed_for(sample_index)
    if seed is not None:
        payload["sampling_seed"] = seed
    return payload


def generate_payload(
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    rid: str,
    sample_index: int = 0,
    return_routed_experts: bool = False,
    routed_experts_start: int = 0,
    image_data: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Body of ``POST /generate`` for one sample (logprobs of the output tokens only); routes from position
    ``routed_experts_start`` on. With ``image_data`` (PNG data URIs, SGLang's ``GenerateReqInput.image_data``),
    ``prompt_ids`` must hold one image pad per image: the server expands them (SGLang 0.5.23 answers already
    expanded ids with HTTP 500, an IndexError in ``base_processor.build_input_ids``)."""
    payload: dict[str, Any] = {
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params_payload(sampling, sample_index),
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": rid,
    }
    if image_data:
        payload["image_data"] = list(image_data)
    if return_routed_experts:
        payload["return_routed_experts"] = True
        if routed_experts_start:
            payload["routed_experts_start_len"] = routed_experts_start
    return payload


def png_data_uri(png: bytes) -> str:
    """An image as ``image_data`` carries it."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def score_payload(
    token_ids: Sequence[int], *, rid: str, image_data: Sequence[str] | None = None
) -> dict[str, Any]:
    """Body of ``POST /generate`` that scores a full sequence without generating (teacher scoring).

    Checked against SGLang's source (``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput``:
    ``input_ids``, ``sampling_params``, ``return_logprob``, ``logprob_start_len`` – "the start location in the
    prompt for returning logprobs", default -1 = output tokens only –, ``rid``; ``entrypoints/http_server.py``
    ``/generate`` returns the tokenizer manager's dict, whose ``meta_info.input_token_logprobs`` is a list of
    ``[logprob, token_id, text]``, one per input token, the first with logprob None). slime's teacher scoring
    sends the same body and reads ``input_token_logprobs[1:]``. Input log-probs come from the raw logits:
    the ``temperature`` here does not change them (teachers score at temperature 1).
    """
    payload: dict[str, Any] = {
        "input_ids": list(token_ids),
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "rid": rid,
    }
    if image_data:  # ids with one pad per image, as in generate_payload; the reply covers the expanded ids
        payload["image_data"] = list(image_data)
    return payload


def finish_reason_json(
    reason: FinishReason, *, matched: int | None = None, length: int | None = None, message: str | None = None
) -> dict[str, Any]:
    """SGLang's ``BaseFinishReason.to_json()`` shapes."""
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": length}
    return {"type": "abort", "message": message or "aborted"}


def encode_routed_experts(routed: np.ndarray) -> str:
    """int array ``[seq_len - 1, num_layers, top_k]`` -> base64 of little-endian int32 (C order)."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype=ROUTED_EXPERTS_DTYPE).tobytes()).decode(
        "ascii"
    )


def decode_routed_experts(
    payload: Any,
    *,
    num_rows: int,
    num_layers: int | None,
    top_k: int | None,
    server: str | None = None,
    request: str | None = None,
) -> np.ndarray:
    """Decode SGLang's ``meta_info.routed_experts`` into int32 ``[num_rows, num_layers, top_k]``.

    ``num_layers`` must be known; ``top_k`` is inferred from the payload size when it is None.
    """
    field = "meta_info.routed_experts"

    def fail(problem: str) -> RolloutError:
        return RolloutError(
            f"bad routed_experts payload: {problem}", server=server, request=request, field=field
        )

    if not isinstance(payload, str):
        raise fail(f"expected a base64 string, got {type(payload).__name__}")
    if num_layers is None:
        raise fail("the client was not told num_layers, so the payload cannot be shaped; pass num_layers=")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise fail(f"not valid base64 ({exc})") from exc
    if len(raw) % ROUTED_EXPERTS_DTYPE.itemsize:
        raise fail(f"{len(raw)} bytes is not a whole number of int32 values")
    flat = np.frombuffer(raw, dtype=ROUTED_EXPERTS_DTYPE)
    per_k = num_rows * num_layers
    if top_k is None:
        if per_k == 0 or flat.size % per_k or flat.size == 0:
            raise fail(
                f"{flat.size} int32 values do not divide into [{num_rows} (= seq_len - 1), {num_layers} layers, top_k]"
            )
        top_k = flat.size // per_k
    if flat.size != per_k * top_k:
        raise fail(
            f"{flat.size} int32 values, expected {per_k * top_k} = "
            f"[{num_rows} (= seq_len - 1), {num_layers} layers, {top_k} top_k]"
        )
    return flat.reshape(num_rows, num_layers, top_k).astype(np.int32, copy=True)


@dataclasses.dataclass
class ParsedGeneration:
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    routed_experts: np.ndarray | None


def _require(mapping: dict[str, Any], key: str, kind: type, fail_field) -> Any:
    if key not in mapping:
        raise fail_field(key, "is missing")
    value = mapping[key]
    if not isinstance(value, kind):
        raise fail_field(key, f"must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_finish_reason(value: Any, fail_field) -> FinishReason:
    if not isinstance(value, dict) or "type" not in value:
        raise fail_field("meta_info.finish_reason", f"must be an object with a 'type', got {value!r}")
    kind = value["type"]
    if kind not in FINISH_REASONS:
        raise fail_field("meta_info.finish_reason", f"has unknown type {kind!r}")
    return kind


def parse_generate_reply(
    reply: Any,
    *,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    rid: str,
    server: str,
    want_routed_experts: bool,
    num_layers: int | None,
    top_k: int | None,
    vocab_size: int | None = None,
    routed_experts_start: int = 0,
    images: int = 0,
) -> ParsedGeneration:
    """Check a ``/generate`` reply for one sample against its request and extract what the trainer needs
    (``vocab_size``: the trainer's vocabulary, which every output id must be in; routes from position
    ``routed_experts_start`` on: ``seq_len - 1 - start`` rows, as SGLang's ``routed_experts_start_len``)."""

    def fail_field(field: str, problem: str) -> RolloutError:
        return RolloutError(
            f"bad /generate reply: {field} {problem}", server=server, request=rid, field=field
        )

    if not isinstance(reply, dict):
        raise fail_field("<body>", f"must be a JSON object, got {type(reply).__name__}")
    meta = _require(reply, "meta_info", dict, fail_field)
    if "id" in meta and meta["id"] != rid:
        raise fail_field("meta_info.id", f"is {meta['id']!r}, the reply belongs to another request")
    finish_reason = parse_finish_reason(meta.get("finish_reason"), fail_field)

    output_ids = _require(reply, "output_ids", list, fail_field)
    if not all(_is_token_id(t) for t in output_ids):
        raise fail_field("output_ids", "must be a list of non-negative token ids")
    outside = [t for t in output_ids if vocab_size is not None and t >= vocab_size]
    if outside:
        raise fail_field(
            "output_ids",
            f"has ids outside the trainer's vocabulary of {vocab_size}: {outside[:5]} (does the server serve "
            "another model or tokenizer?)",
        )
    if len(output_ids) > max_new_tokens:
        raise fail_field(
            "output_ids", f"has {len(output_ids)} tokens, more than max_new_tokens={max_new_tokens}"
        )

    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise fail_field("meta_info.output_token_logprobs", "is missing (was return_logprob ignored?)")
    if len(entries) != len(output_ids):
        raise fail_field(
            "meta_info.output_token_logprobs",
            f"has {len(entries)} entries for {len(output_ids)} output tokens",
        )
    logprobs: list[float] = []
    for t, (entry, token_id) in enumerate(zip(entries, output_ids)):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise fail_field(
                f"meta_info.output_token_logprobs[{t}]", f"must be [logprob, token_id, ...], got {entry!r}"
            )
        if not _finite_number(entry[0]):
            raise fail_field(f"meta_info.output_token_logprobs[{t}]", f"has logprob {entry[0]!r}")
        if entry[1] != token_id:
            raise fail_field(
                f"meta_info.output_token_logprobs[{t}]",
                f"is for token {entry[1]!r}, output_ids has {token_id}",
            )
        logprobs.append(float(entry[0]))

    for key, expected in (("prompt_tokens", len(prompt_ids)), ("completion_tokens", len(output_ids))):
        if key in meta and meta[key] != expected:
            why = ""
            if key == "prompt_tokens" and images:
                why = (
                    " (the trainer's prompt with its images expanded: the server's image processor made other "
                    "grids, so trainer and engine would see different images)"
                )
            raise fail_field(f"meta_info.{key}", f"is {meta[key]!r}, expected {expected}{why}")

    routed = None
    aborted_before_start = finish_reason == "abort" and not output_ids  # no forward ran: no routes
    if want_routed_experts and not (aborted_before_start and meta.get("routed_experts") is None):
        if "routed_experts" not in meta or meta["routed_experts"] is None:
            raise fail_field(
                "meta_info.routed_experts", "is missing; start the server with --enable-return-routed-experts"
            )
        routed = decode_routed_experts(
            meta["routed_experts"],
            num_rows=max(len(prompt_ids) + len(output_ids) - 1 - routed_experts_start, 0),
            num_layers=num_layers,
            top_k=top_k,
            server=server,
            request=rid,
        )
    return ParsedGeneration(
        response_ids=[int(t) for t in output_ids],
        logprobs=logprobs,
        finish_reason=finish_reason,
        routed_experts=routed,
    )


def _clipped_input_id(reported: Any) -> bool:
    """Real SGLang (0.5.23, ``srt/managers/scheduler_components/logprob_result_processor.py:53``) reports input
    token ids ``x if x < vocab_size - 1 else 0`` (meant for image-pad hashes), so the last vocabulary id comes back as
    0 with its correct log-prob. The client does not know the vocabulary size: a reported 0 is accepted for any input
    id (every other position still checks the alignment)."""
    return reported == 0


def parse_score_reply(reply: Any, *, token_ids: Sequence[int], rid: str, server: str) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for ``t = 1 .. len(ids) - 1`` from a ``logprob_start_len=0`` reply."""

    def fail_field(field: str, problem: str) -> RolloutError:
        return RolloutError(f"bad scoring reply: {field} {problem}", server=server, request=rid, field=field)

    if not isinstance(reply, dict):
        raise fail_field("<body>", f"must be a JSON object, got {type(reply).__name__}")
    meta = _require(reply, "meta_info", dict, fail_field)
    if "id" in meta and meta["id"] != rid:
        raise fail_field("meta_info.id", f"is {meta['id']!r}, the reply belongs to another request")
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list):
        raise fail_field("meta_info.input_token_logprobs", "is missing (was logprob_start_len=0 ignored?)")
    if len(entries) != len(token_ids):
        raise fail_field(
            "meta_info.input_token_logprobs", f"has {len(entries)} entries for {len(token_ids)} tokens"
        )
    values: list[float] = []
    for t, (entry, token_id) in enumerate(zip(entries, token_ids)):
        field = f"meta_info.input_token_logprobs[{t}]"
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise fail_field(field, f"must be [logprob, token_id, ...], got {entry!r}")
        if entry[1] != token_id and not _clipped_input_id(entry[1]):
            raise fail_field(field, f"is for token {entry[1]!r}, the input has {token_id}")
        if t == 0:
            continue  # the first token has no prefix; SGLang reports None
        if not _finite_number(entry[0]):
            raise fail_field(field, f"has logprob {entry[0]!r}")
        values.append(float(entry[0]))
    return values
