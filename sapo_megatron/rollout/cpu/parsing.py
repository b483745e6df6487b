"""The CPU server's reading of a request: the JSON body, and a ``/generate`` request checked field by field as
SGLang's ``GenerateReqInput`` (``python/sglang/srt/managers/io_struct.py``) before it joins a batch, so one bad
request never fails its batch-mates. What is refused raises :class:`BadRequest` (HTTP 400, SGLang's
``{"error": {"message"}}``) or :class:`~sapo_megatron.rollout.cpu.weights.InvalidRequest` (a body that is no JSON
object: FastAPI's validation error)."""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from typing import Any

from sapo_megatron.rollout.cpu.engine import RowSpec
from sapo_megatron.rollout.cpu.flags import DEFAULT_MAX_ROWS_PER_REQUEST
from sapo_megatron.rollout.cpu.weights import InvalidRequest
from sapo_megatron.rollout.types import SamplingParams

# sampling_params keys that are accepted; the ones without an effect here only concern text detokenization.
_SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "stop_token_ids",
    "sampling_seed",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "spaces_between_special_tokens",
}
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's signed range, the one every engine accepts


class BadRequest(ValueError):
    """The request cannot be served; answered with HTTP 400."""


def json_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not JSON: {exc}") from exc
    except RecursionError:
        raise InvalidRequest("request body is JSON nested too deeply") from None
    except ValueError as exc:  # a number of more digits than Python converts
        raise InvalidRequest(f"request body holds a value JSON cannot convert: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def validation_error(message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} inputs")
        return value
    return [value] * n


def _sampling(params: Any) -> tuple[SamplingParams, int | None, bool]:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(params).__name__}")
    unknown = set(params) - _SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"sampling_params has unsupported keys {sorted(unknown)}")
    stop = params.get("stop_token_ids") or []
    if not isinstance(stop, list):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of token ids, got {stop!r}")
    try:
        sampling = SamplingParams(
            temperature=_number(params.get("temperature", 1.0), "sampling_params.temperature"),
            top_p=_number(params.get("top_p", 1.0), "sampling_params.top_p"),
            top_k=_integer(params.get("top_k", -1), "sampling_params.top_k"),
            max_new_tokens=_integer(
                params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS), "sampling_params.max_new_tokens"
            ),
            stop_token_ids=tuple(_integer(t, "sampling_params.stop_token_ids") for t in stop),
        )
    except ValueError as exc:
        raise BadRequest(f"bad sampling_params: {exc}") from exc
    seed = params.get("sampling_seed")
    if seed is not None:
        seed = _integer(seed, "sampling_params.sampling_seed")
        if not 0 <= seed <= MAX_SEED:
            raise BadRequest(f"sampling_params.sampling_seed must be in [0, 2^63 - 1], got {seed}")
    return sampling, seed, _flag(params.get("ignore_eos", False), "sampling_params.ignore_eos")


def _number(value: Any, name: str) -> float:
    """A finite JSON number (SGLang's pydantic float, but inf and nan refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(value: Any, name: str) -> int:
    """A JSON integer (an integral float such as 8.0 is taken, as pydantic does; 1e400 or "abc" are not)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


def parse_generate(
    body: dict[str, Any], max_rows: int = DEFAULT_MAX_ROWS_PER_REQUEST
) -> tuple[list[RowSpec], list[dict[str, Any]], bool]:
    """Rows to run, what each reply must echo, and whether the request was a batch."""
    if body.get("text") is not None:
        raise BadRequest("this server has no tokenizer: send input_ids, not text")
    if body.get("stream"):
        raise BadRequest("stream is not supported")
    input_ids = body.get("input_ids")
    if not isinstance(input_ids, list) or not input_ids:
        raise BadRequest("input_ids must be a non-empty list (or list of lists) of token ids")
    batched = isinstance(input_ids[0], list)
    prompts = input_ids if batched else [input_ids]
    for prompt in prompts:
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise BadRequest("input_ids must contain only integer token ids")
    n = len(prompts)
    if n > max_rows:
        raise BadRequest(
            f"input_ids has {n} rows; this server takes at most {max_rows} per request (--max-rows-per-request): "
            "send several requests"
        )
    sampling = _as_list(body.get("sampling_params"), n, "sampling_params")
    rids = body.get("rid")
    if isinstance(rids, str):
        # SGLang expands a single rid of a batch into per-item ids with it as a prefix.
        rids = [rids] if not batched else [f"{rids}_{i}" for i in range(n)]
    rids = _as_list(rids, n, "rid")
    return_logprob = _as_list(body.get("return_logprob") or False, n, "return_logprob")
    start_lens = _as_list(body.get("logprob_start_len", -1), n, "logprob_start_len")
    routed = _flag(body.get("return_routed_experts", False), "return_routed_experts")
    routes_from = _integer(body.get("routed_experts_start_len", 0), "routed_experts_start_len")
    images = _image_data(body.get("image_data"), n, batched)
    rows, echo = [], []
    for i, prompt in enumerate(prompts):
        params, seed, ignore_eos = _sampling(sampling[i])
        start = -1 if start_lens[i] is None else _integer(start_lens[i], "logprob_start_len")
        if start < -1:
            raise BadRequest(f"logprob_start_len must be -1 or >= 0, got {start}")
        if routed and not 0 <= routes_from <= len(prompt):  # SGLang's scheduler refuses the same
            raise BadRequest(
                f"routed_experts_start_len {routes_from} is not in [0, {len(prompt)}] (the number of input tokens)"
            )
        rows.append(
            RowSpec(
                prompt_ids=prompt,
                sampling=params,
                seed=seed,
                return_routed_experts=routed,
                logprob_start_len=start if return_logprob[i] else -1,
                ignore_eos=ignore_eos,
                routed_experts_start=routes_from if routed else 0,
                images=images[i],
            )
        )
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        echo.append({"rid": str(rid), "return_logprob": _flag(return_logprob[i], "return_logprob")})
    return rows, echo, batched


def _image_data(value: Any, n: int, batched: bool) -> list[tuple[bytes, ...]]:
    """Each prompt's images from ``image_data`` (SGLang's shapes: one item or a list per prompt; a list of those
    for a batch), decoded from data URIs."""
    if value is None:
        return [()] * n
    per_prompt = value if batched else [value]
    if not isinstance(per_prompt, list) or len(per_prompt) != n:
        raise BadRequest(f"image_data must give the images of each of the {n} prompts")
    out = []
    for item in per_prompt:
        uris = [] if item is None else item if isinstance(item, list) else [item]
        out.append(tuple(_data_uri(uri) for uri in uris))
    return out


def _data_uri(uri: Any) -> bytes:
    if not isinstance(uri, str) or not uri.startswith("data:image/"):
        raise BadRequest("image_data items must be data:image/...;base64,<data> URIs (no paths, no URLs)")
    header, _, payload = uri.partition(",")
    if not header.endswith(";base64"):
        raise BadRequest("image_data items must be base64 data URIs")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("image_data: invalid base64") from None
