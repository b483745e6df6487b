"""An HTTP server around :class:`CPUEngine` that speaks the part of SGLang's native API this project uses.

It stands in for SGLang servers in tests and CI (also behind the real ``sglang-router``), so requests, replies and
errors follow SGLang field by field (checked against ``python/sglang/srt/entrypoints/http_server.py`` and
``python/sglang/srt/managers/io_struct.py``; see also :mod:`cpu_server_weights` and :mod:`cpu_server_http`).

Endpoints (what each checks):

- ``POST|PUT /generate``: ``input_ids`` (a list or a list of lists of ints in the vocabulary), ``sampling_params``
  (only the keys in ``_SAMPLING_KEYS``), ``return_logprob``, ``logprob_start_len`` (-1 or a prompt position),
  ``return_routed_experts`` (MoE models only), ``rid``; prompt + ``max_new_tokens`` within the context length.
  Errors: 400 ``{"error": {"message"}}``. Concurrent requests are gathered for a few milliseconds and run as one
  batch (the client sends one HTTP request per sample).
- ``GET /health`` (200 at once), ``GET /health_generate`` (200 after generating one token).
- ``GET /get_model_info``: SGLang's ``model_path``, ``tokenizer_path``, ``is_generation``,
  ``preferred_sampling_params``, ``weight_version``, plus the model's shape facts.
- ``GET /get_server_info``: the ``server_args`` fields a client reads (``tp_size`` 1, ``dp_size``, ``pp_size``,
  ``ep_size``, ``enable_return_routed_experts``, ``weight_version``, ``max_running_requests``,
  ``context_length``, ``dtype``, ``quantization``, ...), never the API key. ``GET /get_weight_version``.
- ``GET|POST /flush_cache``: nothing to flush (no prefix cache); 200 with SGLang's text.
- Weight sync (:mod:`cpu_server_weights`): ``POST /update_weights_from_disk``, ``/update_weights_from_tensor``,
  ``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``.
- Unknown paths: 404 ``{"detail": "Not Found"}``; a known path with another method: 405, as FastAPI answers.

With ``api_key`` (``--api-key``) every path but ``/health*`` needs ``Authorization: Bearer <key>`` (401
``{"error": "Unauthorized"}`` otherwise). Start in-process with ``CPUServer(engine).start()`` (port 0 picks a free
port) or from the shell with SGLang's flags: ``python -m sapo_megatron.rollout.cpu_server --model-path DIR --port P``
(see :func:`add_serve_arguments`). SGLang's ``--dtype`` and ``--quantization fp8`` set the engine's precision
(:func:`precision_from_flags`).
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from http import HTTPStatus
from pathlib import Path
from typing import Any

from sapo_megatron import __version__
from sapo_megatron.errors import UserError
from sapo_megatron.rollout.cpu_engine import CPUEngine, RowResult, RowSpec
from sapo_megatron.rollout.cpu_server_http import (
    UNAUTHORIZED,
    HTTPServer,
    Response,
    authorized,
    json_response,
    text_response,
)
from sapo_megatron.rollout.cpu_server_weights import InvalidRequest, WeightEndpoints
from sapo_megatron.rollout.protocol import encode_routed_experts, finish_reason_json
from sapo_megatron.rollout.types import SamplingParams
from sapo_megatron.rollout.weight_group import DEFAULT_TIMEOUT_S

logger = logging.getLogger(__name__)

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


class BadRequest(ValueError):
    """The request cannot be served; answered with HTTP 400."""


class _Batcher:
    """Runs queued rows through the engine in batches, gathering arrivals for ``window_s``."""

    def __init__(self, engine: CPUEngine, window_s: float, max_rows: int) -> None:
        self.engine = engine
        self.window_s = window_s
        self.max_rows = max_rows
        self._queue: queue.Queue[tuple[list[RowSpec], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="cpu-server-batcher", daemon=True)
        self._thread.start()

    def submit(self, rows: list[RowSpec]) -> Future:
        future: Future = Future()
        self._queue.put((rows, future))
        return future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            items = [item]
            deadline = time.monotonic() + self.window_s
            stopping = False
            while sum(len(rows) for rows, _ in items) < self.max_rows:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    nxt = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True
                    break
                items.append(nxt)
            self._run(items)
            if stopping:
                break
        while True:  # fail what is still queued
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(RuntimeError("server stopped"))

    def _run(self, items: list[tuple[list[RowSpec], Future]]) -> None:
        all_rows = [row for rows, _ in items for row in rows]
        try:
            results = self.engine.generate_rows(all_rows)
        except Exception as exc:  # handed to each waiting request, which answers 500
            logger.exception("generation failed")
            for _, future in items:
                future.set_exception(exc)
            return
        offset = 0
        for rows, future in items:
            future.set_result(results[offset : offset + len(rows)])
            offset += len(rows)


class ServeError(UserError):
    """The server cannot start with these settings (bad flag, model directory, address)."""


Handler = Callable[[dict[str, Any]], tuple[HTTPStatus, Any]]
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class CPUServer:
    """The HTTP front of one :class:`CPUEngine`; binds 127.0.0.1 by default and listens on construction.

    ``api_key``: require ``Authorization: Bearer <api_key>`` like SGLang's ``--api-key``. ``dist_timeout_s``: how
    long a weights update group may take to form, and each broadcast over it.
    """

    def __init__(
        self,
        engine: CPUEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        batch_window_s: float = 0.005,
        tokenizer: Any = None,
        api_key: str | None = None,
        dist_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._tokenizer_path = (
            None if tokenizer is None else str(getattr(tokenizer, "directory", engine.model_path))
        )
        self.api_key = api_key
        self.batcher = _Batcher(engine, batch_window_s, engine.max_batch_size)
        self.weights = WeightEndpoints(engine, dist_timeout_s=dist_timeout_s)
        self.stopped = False
        self._routes = self._build_routes()
        self._httpd = HTTPServer((host, port), self)
        self._thread: threading.Thread | None = None
        self._serving = False
        self._closed = False
        self._stop_lock = threading.Lock()

    @property
    def tokenizer_path(self) -> str | None:
        """Where the tokenizer was loaded from (the model directory at start), as SGLang reports it; None
        without one."""
        return self._tokenizer_path

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> CPUServer:
        self._serving = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="cpu-server", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._serving = True
        self._httpd.serve_forever()

    def stop(self) -> None:
        """Stop accepting, drop requests in flight without a reply (like a crashed server), free the port."""
        with self._stop_lock:
            if self._closed:
                return
            self._closed = True
        self.stopped = True  # from here on handlers answer nothing
        if self._serving:
            self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.drop_connections()
        self.batcher.stop()
        self.weights.close()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> CPUServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ routing
    def _build_routes(self) -> dict[str, tuple[tuple[str, ...], Handler]]:
        weights = self.weights
        return {
            "/generate": (("POST", "PUT"), lambda body: (HTTPStatus.OK, self.generate(body))),
            "/health": (("GET",), lambda _: (HTTPStatus.OK, "")),
            "/health_generate": (("GET",), lambda _: (HTTPStatus.OK, self.health_generate())),
            "/get_model_info": (("GET",), lambda _: (HTTPStatus.OK, self.model_info())),
            "/get_server_info": (("GET",), lambda _: (HTTPStatus.OK, self.server_info())),
            "/get_weight_version": (
                ("GET",),
                lambda _: (HTTPStatus.OK, {"weight_version": weights.weight_version}),
            ),
            "/flush_cache": (("GET", "POST"), lambda _: (HTTPStatus.OK, FLUSH_CACHE_TEXT)),
            "/update_weights_from_disk": (("POST",), weights.update_from_disk),
            "/update_weights_from_tensor": (("POST",), weights.update_from_tensor),
            "/init_weights_update_group": (("POST",), weights.init_group),
            "/destroy_weights_update_group": (("POST",), weights.destroy_group),
            "/update_weights_from_distributed": (("POST",), weights.update_from_distributed),
        }

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Response:
        """One request: authorization, route, JSON body, and SGLang's error shapes."""
        if not authorized(method, path, headers, self.api_key):
            return UNAUTHORIZED
        route = self._routes.get(path)
        if route is None:
            return json_response(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
        methods, handler = route
        if method not in methods:
            return json_response(HTTPStatus.METHOD_NOT_ALLOWED, {"detail": "Method Not Allowed"})
        try:
            status, payload = handler(_json_body(body) if method != "GET" else {})
        except InvalidRequest as exc:  # FastAPI's RequestValidationError, as SGLang answers it
            return json_response(HTTPStatus.BAD_REQUEST, _validation_error(str(exc)))
        except BadRequest as exc:  # SGLang's _create_error_response
            return json_response(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}})
        if isinstance(payload, str):
            return text_response(status, payload)
        return json_response(status, payload)

    # ------------------------------------------------------------------ endpoints
    def generate(self, body: dict[str, Any]) -> Any:
        rows, echo, batched = _parse_generate(self._with_input_ids(body))
        for row in rows:
            try:
                self.engine.validate_row(row)
            except ValueError as exc:
                raise BadRequest(str(exc)) from exc
        results: list[RowResult] = self.batcher.submit(rows).result()
        replies = [self._reply(row, res, info) for row, res, info in zip(rows, results, echo)]
        return replies if batched else replies[0]

    def _reply(self, row: RowSpec, res: RowResult, info: dict[str, Any]) -> dict[str, Any]:
        if res.finish_reason == "stop":
            finish = finish_reason_json("stop", matched=res.matched_stop)
        else:
            finish = finish_reason_json("length", length=row.sampling.max_new_tokens)
        meta: dict[str, Any] = {
            "id": info["rid"],
            "finish_reason": finish,
            "prompt_tokens": len(row.prompt_ids),
            "completion_tokens": len(res.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weights.weight_version,
        }
        if info["return_logprob"]:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(res.output_logprobs, res.output_ids)
            ]
            if res.input_logprobs is not None:
                ids = row.prompt_ids[row.logprob_start_len :]
                meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(res.input_logprobs, ids)]
            else:
                meta["input_token_logprobs"] = []
        if res.routed_experts is not None:
            meta["routed_experts"] = encode_routed_experts(res.routed_experts)
        return {"text": self._text(res.output_ids), "output_ids": res.output_ids, "meta_info": meta}

    def _with_input_ids(self, body: dict[str, Any]) -> dict[str, Any]:
        """A ``text`` request as ``input_ids``: encoded as SGLang's tokenizer manager does, with the tokenizer's
        own special tokens (``tokenizer(text)``; the char tokenizer's HF export prepends ``<bos>``)."""
        text = body.get("text")
        if text is None:
            return body
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer: send input_ids, not text")
        if body.get("input_ids") is not None:
            raise BadRequest("send either text or input_ids, not both")
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        try:
            ids = [_encode_text(self.tokenizer, t) for t in texts]
        except ValueError as exc:  # e.g. a character the char tokenizer lacks
            raise BadRequest(str(exc)) from exc
        return {**body, "text": None, "input_ids": ids if isinstance(text, list) else ids[0]}

    def _text(self, ids: list[int]) -> str:
        """Decoded output for humans; token ids are the contract, so ids the tokenizer lacks give ""."""
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(ids)
        except ValueError:
            return ""

    def health_generate(self) -> str:
        row = RowSpec(prompt_ids=[0], sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        self.batcher.submit([row]).result(timeout=60)
        return ""

    def model_info(self) -> dict[str, Any]:
        return {
            **self.engine.model_info(),
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weights.weight_version,
        }

    def server_info(self) -> dict[str, Any]:
        """The ``server_args`` (and scheduler) fields of SGLang's reply that a client reads; no API key."""
        host, port = self._httpd.server_address[:2]
        return {
            "model_path": self.engine.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.engine.model_path,
            "host": host,
            "port": port,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "enable_return_routed_experts": self.engine.is_moe,
            **self.engine.numerics.describe(),  # dtype, quantization (resolved, e.g. "bfloat16" and "fp8")
            "skip_tokenizer_init": self.tokenizer is None,
            "max_running_requests": self.engine.max_batch_size,
            "context_length": self.engine.max_context,
            "random_seed": self.engine.seed,
            "dist_timeout": self.weights.dist_timeout_s,
            "weight_version": self.weights.weight_version,
            "version": __version__,
            "served_by": "sapo_megatron.rollout.cpu_server",
        }


def _json_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _validation_error(message: str) -> dict[str, Any]:
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
    try:
        sampling = SamplingParams(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            max_new_tokens=int(params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)),
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
        )
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"bad sampling_params: {exc}") from exc
    seed = params.get("sampling_seed")
    return sampling, None if seed is None else int(seed), bool(params.get("ignore_eos", False))


def _parse_generate(body: dict[str, Any]) -> tuple[list[RowSpec], list[dict[str, Any]], bool]:
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
    sampling = _as_list(body.get("sampling_params"), n, "sampling_params")
    rids = body.get("rid")
    if isinstance(rids, str):
        # SGLang expands a single rid of a batch into per-item ids with it as a prefix.
        rids = [rids] if not batched else [f"{rids}_{i}" for i in range(n)]
    rids = _as_list(rids, n, "rid")
    return_logprob = _as_list(body.get("return_logprob") or False, n, "return_logprob")
    start_lens = _as_list(body.get("logprob_start_len", -1), n, "logprob_start_len")
    routed = bool(body.get("return_routed_experts", False))
    rows, echo = [], []
    for i, prompt in enumerate(prompts):
        params, seed, ignore_eos = _sampling(sampling[i])
        start = -1 if start_lens[i] is None else int(start_lens[i])
        if start < -1:
            raise BadRequest(f"logprob_start_len must be -1 or >= 0, got {start}")
        rows.append(
            RowSpec(
                prompt_ids=prompt,
                sampling=params,
                seed=seed,
                return_routed_experts=routed,
                logprob_start_len=start if return_logprob[i] else -1,
                ignore_eos=ignore_eos,
            )
        )
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        echo.append({"rid": str(rid), "return_logprob": bool(return_logprob[i])})
    return rows, echo, batched


def _load_tokenizer(model_dir: Path) -> Any:
    """The model directory's tokenizer: the char tokenizer, else an HF tokenizer (one this project cannot use is
    skipped with a warning), else None (ids only)."""
    from sapo_megatron.data.tokenizer import HF_TOKENIZER_FILES, TOKENIZER_FILE, CharTokenizer, HFTokenizer

    if (model_dir / TOKENIZER_FILE).is_file():
        return CharTokenizer.load(model_dir)
    if any((model_dir / name).is_file() for name in HF_TOKENIZER_FILES):
        try:
            return HFTokenizer(model_dir)
        except UserError as exc:  # e.g. no eos token: serve token ids only, as without a tokenizer
            logger.warning("serving %s without its tokenizer (input_ids only): %s", model_dir, exc)
    return None


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return hf(text)["input_ids"]
    return tokenizer.encode(text, add_bos=True)


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    seed: int = 0,
    num_threads: int | None = None,
    block: bool = True,
    api_key: str | None = None,
    dist_timeout_s: float = DEFAULT_TIMEOUT_S,
    precision: str = "fp32",
) -> CPUServer:
    """Load ``model_dir`` and serve it in ``precision`` (fp32, bf16, fp8). ``block=False`` returns the started
    server (stop it with ``.stop()``)."""
    try:
        engine = CPUEngine.from_pretrained(model_dir, seed=seed, num_threads=num_threads, precision=precision)
    except FileNotFoundError as exc:
        raise ServeError(f"--model-path {model_dir}: {exc}") from exc
    try:
        server = CPUServer(
            engine,
            host=host,
            port=port,
            tokenizer=_load_tokenizer(Path(model_dir)),
            api_key=api_key,
            dist_timeout_s=dist_timeout_s,
        )
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc}") from exc
    logger.info("serving %s at %s in %s", model_dir, server.url, precision)
    if not block:
        return server.start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return server


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """SGLang's ``launch_server`` flags that mean something here (same names, so scripts can swap servers)."""
    parser.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        required=True,
        help="HF checkpoint directory (config.json)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port",
        type=int,
        default=30000,
        help="port to listen on, 0 for any free port (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health* (default: %(default)s, no key)",
    )
    parser.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        "--tp",
        dest="tp_size",
        type=int,
        default=1,
        help="tensor-parallel size; the CPU server runs one rank, so only 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="accepted for SGLang compatibility: MoE models always return routed experts on request "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="weights and activations: bfloat16 or float32 (float); auto is float32 without --quantization and "
        "bfloat16 with it (SGLang's auto would serve a float32 checkpoint in float16); half/float16 are refused "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        help="fp8: SGLang's block-wise W8A8 fp8 (128x128 weight blocks) on the decoder's linear layers, with "
        "bfloat16 activations; the only method here (default: %(default)s, none)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the forwards (default: %(default)s: torch's)",
    )
    parser.add_argument(
        "--seed",
        "--random-seed",
        dest="seed",
        type=int,
        default=0,
        help="seed for requests without sampling_seed (default: %(default)s)",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a weights update group may take to form, and each broadcast over it (default: %(default)s)",
    )


# SGLang's --dtype choices (server_args.py): "float" means float32 and "half" float16.
DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def precision_from_flags(dtype: str = "auto", quantization: str | None = None) -> str:
    """The engine precision (fp32, bf16, fp8) that SGLang's ``--dtype`` and ``--quantization`` ask for.

    ``auto`` keeps float32 without quantisation and means bfloat16 under fp8, which SGLang runs with bfloat16 or
    float16 activations only (``Fp8Config.get_supported_act_dtypes``); float16 is not implemented here.
    """
    if dtype not in DTYPE_CHOICES:
        raise ServeError(f"--dtype {dtype}: choose one of {', '.join(DTYPE_CHOICES)}")
    if dtype in ("half", "float16"):
        raise ServeError(f"--dtype {dtype}: the CPU server runs float32 or bfloat16, not float16")
    if quantization is None:
        return "bf16" if dtype == "bfloat16" else "fp32"
    if quantization != "fp8":
        raise ServeError(f"--quantization {quantization}: the CPU server implements only fp8")
    if dtype in ("float", "float32"):
        raise ServeError(
            f"--dtype {dtype} with --quantization fp8: fp8 runs bfloat16 activations, as in SGLang; "
            "use --dtype bfloat16 or auto"
        )
    return "fp8"


def serve_from_args(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; prints ``serving <model dir> at <url>`` once listening. Returns 0."""
    precision = precision_from_flags(args.dtype, args.quantization)
    if args.tp_size != 1:
        raise ServeError(
            f"--tp-size {args.tp_size}: the CPU server runs a single rank, only --tp-size 1 works"
        )
    if args.dist_timeout <= 0:
        raise ServeError(f"--dist-timeout must be positive, got {args.dist_timeout}")
    stop_requested = threading.Event()
    with _stop_on_signals(stop_requested):
        server = serve(
            args.model_path,
            args.host,
            args.port,
            seed=args.seed,
            num_threads=args.threads,
            block=False,
            api_key=args.api_key,
            dist_timeout_s=args.dist_timeout,
            precision=precision,
        )
        print(f"serving {args.model_path} at {server.url}", flush=True)
        try:
            while not stop_requested.wait(0.5):
                pass
        finally:
            server.stop()
    return 0


class _stop_on_signals:
    """Turn SIGTERM and SIGINT into ``event.set()`` while active (main thread only; elsewhere a no-op)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.previous[signum] = signal.signal(signum, lambda *_: self.event.set())

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sapo_megatron.rollout.cpu_server",
        description="Serve an HF causal LM on CPU with the part of SGLang's HTTP API this project uses",
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return serve_from_args(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
