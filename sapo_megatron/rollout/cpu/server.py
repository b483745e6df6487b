"""An HTTP server around :class:`CPUEngine` that speaks the part of SGLang's native API this project uses.

It stands in for SGLang servers in tests and CI (also behind the real ``sglang-router``), so requests, replies and
errors follow SGLang field by field (checked against ``python/sglang/srt/entrypoints/http_server.py`` and
``python/sglang/srt/managers/io_struct.py``). The parts: :mod:`.http` (the HTTP/1.1 front and its limits),
:mod:`.parsing` (reading a request), :mod:`.continuous` and :mod:`.batcher` (batching), :mod:`.weights` and :mod:`.memory` (endpoints).

Endpoints (what each checks):

- ``POST|PUT /generate``: ``input_ids`` (a list or a list of lists of ints in the vocabulary), ``sampling_params``
  (only the keys in ``parsing._SAMPLING_KEYS``), ``return_logprob``, ``logprob_start_len`` (-1 or a prompt position),
  ``return_routed_experts`` (MoE models only) with ``routed_experts_start_len``, ``rid``, ``image_data`` (VL
  models: per prompt a ``data:image/...;base64,`` URI or a list of them, one per image pad of the prompt; file paths
  and URLs are refused, a server reads no files and fetches nothing for a client); prompt + ``max_new_tokens``
  within the context length. With images the prompt's pads are expanded by the model's image processor, as SGLang
  does, and ``prompt_tokens`` counts the expanded prompt.
  Errors: 400 ``{"error": {"message"}}``. Requests are batched continuously, as SGLang's scheduler does
  (:mod:`.continuous`): a request joins the running batch between two decode steps and is answered as soon as its
  rows finish; with ``static_batches`` (``--static-batches``) concurrent requests are gathered for a few
  milliseconds and run as one batch to completion. Every field is checked before a request joins a batch
  (types, finite temperature / top_p, ``sampling_seed`` in [0, 2^63), at most ``max_rows_per_request`` rows), so
  one bad request never fails its batch-mates; if a batch fails anyway, its requests are retried one by one. A
  request whose client hung up before it joined a batch is dropped without computing it (with continuous
  batching, also one that hangs up while it runs).
- ``GET /health`` (200 at once), ``GET /health_generate`` (200 after generating one token).
- ``GET /get_model_info``: SGLang's ``model_path``, ``tokenizer_path``, ``is_generation``,
  ``preferred_sampling_params``, ``weight_version``, plus the model's shape facts.
- ``GET /get_server_info``: the ``server_args`` fields a client reads (``tp_size`` 1, ``dp_size``, ``pp_size``,
  ``ep_size``, ``enable_return_routed_experts``, ``weight_version``, ``max_running_requests``,
  ``context_length``, ``dtype``, ``quantization``, ...), never the API key. ``GET /get_weight_version``.
- ``GET|POST /flush_cache``: nothing to flush (no prefix cache); 200 with SGLang's text, 400 while requests run.
- Memory (:mod:`.memory`): ``/release_memory_occupation``, ``/resume_memory_occupation``;
  ``/weights_checker`` with ``action: checksum`` (SGLang's served names and hashes, see
  :mod:`sapo_megatron.rollout.weight_checksum`).
- Weight sync (:mod:`.weights`): ``POST /update_weights_from_disk``, ``/update_weights_from_tensor``,
  ``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
  ``/begin_weight_update``, ``/end_weight_update`` (SGLang 0.5.23's weight-update sessions).
- ``POST /pause_generation`` ``{"mode": "abort" | "retract" | "in_place"}`` (default abort) and
  ``POST /continue_generation`` ``{"torch_empty_cache"}``, as SGLang 0.5.23 (:mod:`.pause` cites its source):
  200 ``{"message": "Generation paused successfully.", "status": "ok"}`` once no forward runs; weights may be
  updated while paused; new requests wait for the continue. ``abort`` finishes running and queued requests with
  ``finish_reason {"type": "abort", ...}`` and the tokens made so far; ``in_place`` keeps running requests and
  their cache; ``retract`` keeps their tokens and prefills them again with the weights of the continue. Replies
  carry SGLang's ``meta_info.weight_versions``: the output tokens as spans ``{"version", "start", "end"}`` of the
  weight version label (an update's ``weight_version``) whose forward made them.
- Unknown paths: 404 ``{"detail": "Not Found"}``; a known path with another method: 405, as FastAPI answers.

With ``api_key`` (``--api-key``) every path but ``/health*`` needs ``Authorization: Bearer <key>`` (401
``{"error": "Unauthorized"}`` otherwise). Start in-process with ``CPUServer(engine).start()`` (port 0 picks a free
port) or from the shell with SGLang's flags: ``python -m sapo_megatron.rollout.cpu.server --model-path DIR --port P``
(see :func:`add_serve_arguments`). SGLang's ``--dtype`` and ``--quantization fp8`` set the engine's precision
(:func:`precision_from_flags`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any

from sapo_megatron import __version__
from sapo_megatron.checkpoint.hf_io import CheckpointError
from sapo_megatron.errors import UserError
from sapo_megatron.rollout.cpu.batcher import Batcher, QueueBatcher
from sapo_megatron.rollout.cpu.continuous import ContinuousBatcher
from sapo_megatron.rollout.cpu.engine import CPUEngine, RowResult, RowSpec
from sapo_megatron.rollout.cpu.flags import (  # re-exported
    DEFAULT_MAX_ROWS_PER_REQUEST,
    DTYPE_CHOICES,
    add_serve_arguments,
)
from sapo_megatron.rollout.cpu.http import (
    HTTPServer,
    Limits,
    Request,
    Response,
    authorized,
    json_response,
    text_response,
)
from sapo_megatron.rollout.cpu.memory import MemoryEndpoints
from sapo_megatron.rollout.cpu.parsing import BadRequest, json_body, parse_generate, validation_error
from sapo_megatron.rollout.cpu.pause import PAUSE_MODES
from sapo_megatron.rollout.cpu.weights import (
    _OPTIONAL_STR,
    InvalidRequest,
    WeightEndpoints,
    WeightGuard,
    _fields,
)
from sapo_megatron.rollout.protocol import encode_routed_experts, finish_reason_json
from sapo_megatron.rollout.types import SamplingParams
from sapo_megatron.rollout.weight_group import DEFAULT_TIMEOUT_S

logger = logging.getLogger(__name__)


class ServeError(UserError):
    """The server cannot start with these settings (bad flag, model directory, address)."""


Handler = Callable[[dict[str, Any], Request], tuple[HTTPStatus, Any]]
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_CACHE_FAILED_TEXT = "Flush cache failed.\n"
_BASE_REQ = {
    "rid": (_OPTIONAL_STR, None),
    "http_worker_ipc": (_OPTIONAL_STR, None),
}  # SGLang's BaseReq fields  # SGLang: ret.message or this, with HTTP 400


class CPUServer:
    """The HTTP front of one :class:`CPUEngine`; binds 127.0.0.1 by default and listens on construction.

    ``api_key``: require ``Authorization: Bearer <api_key>`` like SGLang's ``--api-key``. ``dist_timeout_s``: how
    long a weights update group may take to form, and each broadcast over it. ``static_batches``: run gathered
    requests as static batches (within ``batch_window_s``) instead of continuous batching.
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
        limits: Limits | None = None,
        max_rows_per_request: int = DEFAULT_MAX_ROWS_PER_REQUEST,
        guard: WeightGuard | None = None,
        memory_saver: bool = False,
        weights_cpu_backup: bool = False,
        static_batches: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._tokenizer_path = (
            None if tokenizer is None else str(getattr(tokenizer, "directory", engine.model_path))
        )
        self.api_key = api_key
        self.max_rows_per_request = max_rows_per_request
        self.batcher: QueueBatcher = (
            Batcher(engine, batch_window_s, engine.max_batch_size)
            if static_batches
            else ContinuousBatcher(engine, engine.max_batch_size)
        )
        self.weights = WeightEndpoints(engine, dist_timeout_s=dist_timeout_s, guard=guard)
        self.memory = MemoryEndpoints(
            engine,
            busy=lambda: self.batcher.pending > 0,
            crash=self._crash,
            memory_saver=memory_saver,
            weights_cpu_backup=weights_cpu_backup,
        )
        self.stopped = False
        self._routes = self._build_routes()
        self._httpd = HTTPServer((host, port), self, limits)
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
        return f"http://{host!s}:{port}"

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

    def _crash(self) -> None:
        """Go down as SGLang does when its scheduler raises: answer nothing from now on, then stop."""
        self.stopped = True
        threading.Thread(target=self.stop, name="cpu-server-crash", daemon=True).start()

    def __enter__(self) -> CPUServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ routing
    def _build_routes(self) -> dict[str, tuple[tuple[str, ...], Handler]]:
        weights = self.weights
        return {
            "/generate": (("POST", "PUT"), lambda body, req: (HTTPStatus.OK, self.generate(body, req))),
            "/health": (("GET",), lambda *_: (HTTPStatus.OK, "")),
            "/health_generate": (("GET",), lambda *_: (HTTPStatus.OK, self.health_generate())),
            "/get_model_info": (("GET",), lambda *_: (HTTPStatus.OK, self.model_info())),
            "/get_server_info": (("GET",), lambda *_: (HTTPStatus.OK, self.server_info())),
            "/get_weight_version": (
                ("GET",),
                lambda *_: (HTTPStatus.OK, {"weight_version": weights.weight_version}),
            ),
            "/flush_cache": (("GET", "POST"), lambda *_: self.flush_cache()),
            "/release_memory_occupation": (("GET", "POST"), self.memory.release),
            "/resume_memory_occupation": (("GET", "POST"), self.memory.resume),
            "/weights_checker": (("GET", "POST"), self.memory.check_weights),
            "/update_weights_from_disk": (("POST",), weights.update_from_disk),
            "/update_weights_from_tensor": (("POST",), weights.update_from_tensor),
            "/init_weights_update_group": (("POST",), weights.init_group),
            "/destroy_weights_update_group": (("POST",), weights.destroy_group),
            "/update_weights_from_distributed": (("POST",), weights.update_from_distributed),
            "/begin_weight_update": (("POST",), weights.begin_session),
            "/end_weight_update": (("POST",), weights.end_session),
            "/pause_generation": (("POST",), self.pause_generation),
            "/continue_generation": (("POST",), self.continue_generation),
        }

    def authorize(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        return authorized(method, path, headers, self.api_key)

    def handle(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        request: Request | None = None,
    ) -> Response:
        """One authorized request: route, JSON body, and SGLang's error shapes."""
        request = request or Request(peer_host="127.0.0.1")
        route = self._routes.get(path)
        if route is None:
            return json_response(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
        methods, handler = route
        if method not in methods:
            return json_response(HTTPStatus.METHOD_NOT_ALLOWED, {"detail": "Method Not Allowed"})
        try:
            status, payload = handler(json_body(body) if method != "GET" else {}, request)
        except InvalidRequest as exc:  # FastAPI's RequestValidationError, as SGLang answers it
            return json_response(HTTPStatus.BAD_REQUEST, validation_error(str(exc)))
        except BadRequest as exc:  # SGLang's _create_error_response
            return json_response(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}})
        if isinstance(payload, str):
            return text_response(status, payload)
        return json_response(status, payload)

    # ------------------------------------------------------------------ endpoints
    def pause_generation(
        self, body: dict[str, Any], _request: Request | None = None
    ) -> tuple[HTTPStatus, Any]:
        """SGLang's ``PauseGenerationReqInput`` (``mode``: abort | retract | in_place, default abort; see
        :mod:`.pause`); answers once no forward runs."""
        mode = _fields(body, {"mode": (str, "abort"), **_BASE_REQ})["mode"]
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.engine.pause_generation(mode)
        return HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(
        self, body: dict[str, Any], _request: Request | None = None
    ) -> tuple[HTTPStatus, Any]:
        """SGLang's ``ContinueGenerationReqInput`` (``torch_empty_cache``: accepted, nothing to free on CPU)."""
        _fields(body, {"torch_empty_cache": (bool, True), **_BASE_REQ})
        self.engine.continue_generation()
        return HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"}

    def flush_cache(self) -> tuple[HTTPStatus, str]:
        """Nothing to flush (no prefix cache); refused (400) while requests run or wait, as SGLang's scheduler
        refuses (``flush_cache``: "Cache not flushed because there are pending requests"), except during a retract
        or abort pause, whose requests hold no cache (SGLang: ``is_fully_idle(ignore_waiting=_engine_paused)``)."""
        if self.batcher.pending and self.engine.pause_gate.mode not in ("retract", "abort"):
            return HTTPStatus.BAD_REQUEST, FLUSH_CACHE_FAILED_TEXT
        return HTTPStatus.OK, FLUSH_CACHE_TEXT

    def generate(self, body: dict[str, Any], request: Request | None = None) -> Any:
        self.memory.check_serving()
        rows, echo, batched = parse_generate(self._with_input_ids(body), self.max_rows_per_request)
        for row in rows:
            try:
                if row.images:
                    self.engine.prepare_images(row)
                self.engine.validate_row(row)
            except ValueError as exc:
                raise BadRequest(str(exc)) from exc
        client_gone = request.client_gone if request is not None else lambda: False
        results: list[RowResult] = self.batcher.submit(rows, client_gone).result()
        replies = [self._reply(row, res, info) for row, res, info in zip(rows, results, echo)]
        return replies if batched else replies[0]

    def _reply(self, row: RowSpec, res: RowResult, info: dict[str, Any]) -> dict[str, Any]:
        if res.finish_reason == "stop":
            finish = finish_reason_json("stop", matched=res.matched_stop)
        elif res.finish_reason == "abort":  # SGLang's FINISH_ABORT().to_json()
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        else:
            finish = finish_reason_json("length", length=row.sampling.max_new_tokens)
        meta: dict[str, Any] = {
            "id": info["rid"],
            "finish_reason": finish,
            "prompt_tokens": len(row.prompt_ids),
            "completion_tokens": len(res.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weights.weight_version,
            "weight_versions": self._version_spans(res.token_versions),
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

    def _version_spans(self, versions: list[int]) -> list[dict[str, Any]]:
        """SGLang 0.5.23's ``meta_info.weight_versions`` (``srt/utils/weight_versions.py``): the output tokens as
        spans ``{"version", "start", "end"}`` of one weight version label each."""
        spans: list[dict[str, Any]] = []
        for t, version in enumerate(versions):
            label = self.weights.label_of(version)
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = t + 1
            else:
                spans.append({"version": label, "start": t, "end": t + 1})
        return spans or [{"version": self.weights.weight_version, "start": 0, "end": 0}]

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
            "served_by": "sapo_megatron.rollout.cpu.server",
        }


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
    limits: Limits | None = None,
    max_rows_per_request: int = DEFAULT_MAX_ROWS_PER_REQUEST,
    guard: WeightGuard | None = None,
    memory_saver: bool = False,
    weights_cpu_backup: bool = False,
    static_batches: bool = False,
) -> CPUServer:
    """Load ``model_dir`` and serve it in ``precision`` (fp32, bf16, fp8). ``block=False`` returns the started
    server (stop it with ``.stop()``)."""
    try:
        engine = CPUEngine.from_pretrained(model_dir, seed=seed, num_threads=num_threads, precision=precision)
    except (FileNotFoundError, CheckpointError) as exc:
        raise ServeError(f"--model-path {model_dir}: {exc}") from exc
    try:
        server = CPUServer(
            engine,
            host=host,
            port=port,
            tokenizer=_load_tokenizer(Path(model_dir)),
            api_key=api_key,
            dist_timeout_s=dist_timeout_s,
            limits=limits,
            max_rows_per_request=max_rows_per_request,
            guard=guard,
            memory_saver=memory_saver,
            weights_cpu_backup=weights_cpu_backup,
            static_batches=static_batches,
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
    for flag in ("max_body_bytes", "max_connections", "max_rows_per_request", "weight_group_connect_timeout"):
        if getattr(args, flag) <= 0:
            raise ServeError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    warn_if_exposed(args.host, args.api_key)
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
            limits=Limits(max_body_bytes=args.max_body_bytes, max_connections=args.max_connections),
            max_rows_per_request=args.max_rows_per_request,
            guard=WeightGuard(
                allowed_weight_dirs=args.allowed_weight_dir or [Path(args.model_path).resolve().parent],
                allowed_master_addresses=args.allowed_master_address,
                tensor_sender_pids=args.tensor_sender_pid,
                connect_timeout_s=args.weight_group_connect_timeout,
            ),
            memory_saver=args.enable_memory_saver,
            weights_cpu_backup=args.enable_weights_cpu_backup,
            static_batches=args.static_batches,
        )
        print(f"serving {args.model_path} at {server.url}", flush=True)
        try:
            while not stop_requested.wait(0.5):
                pass
        finally:
            server.stop()
    return 0


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Print a warning (and return True) when the server listens beyond loopback without an API key."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback or api_key is not None:
        return False
    print(
        f"warning: --host {host} without --api-key: anyone who reaches this address can generate and replace the "
        "served weights; set --api-key (the trainer reads it from rollout.api_key_env)",
        file=sys.stderr,
        flush=True,
    )
    return True


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
        prog="python -m sapo_megatron.rollout.cpu.server",
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
