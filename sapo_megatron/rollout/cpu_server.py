"""An HTTP server around :class:`CPUEngine` that speaks the subset of SGLang's native API the client uses.

Endpoints: ``POST /generate`` (``input_ids`` as a list or a list of lists, ``sampling_params``, ``return_logprob``,
``logprob_start_len`` -1 or >= 0, ``return_routed_experts``, ``rid``), ``POST /update_weights_from_disk``
(``model_path``), ``GET|POST /flush_cache``, ``GET /health``, ``GET /health_generate``, ``GET /get_model_info``,
``GET /get_server_info``. Errors are answered like SGLang: HTTP 400 with ``{"error": {"message": ...}}``.

Concurrent ``/generate`` requests are gathered for a few milliseconds and run as one batch (the client sends one
HTTP request per sample). Start in-process with ``CPUServer(engine).start()`` (port 0 picks a free port) or from the
shell with ``python -m sapo_megatron.rollout.cpu_server --model DIR --port P``.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sapo_megatron.rollout.cpu_engine import CPUEngine, RowResult, RowSpec
from sapo_megatron.rollout.protocol import encode_routed_experts, finish_reason_json
from sapo_megatron.rollout.types import SamplingParams

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


class CPUServer:
    """The HTTP front of one :class:`CPUEngine`; binds 127.0.0.1 by default."""

    def __init__(
        self,
        engine: CPUEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        batch_window_s: float = 0.005,
        tokenizer: Any = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.batcher = _Batcher(engine, batch_window_s, engine.max_batch_size)
        self.stopped = False
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.app = self
        self._thread: threading.Thread | None = None
        self._serving = False
        self._closed = False
        self._stop_lock = threading.Lock()

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
        self.batcher.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> CPUServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ endpoints
    def generate(self, body: dict[str, Any]) -> Any:
        rows, echo, batched = _parse_generate(body)
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
            "weight_version": str(self.engine.weight_version),
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

    def _text(self, ids: list[int]) -> str:
        """Decoded output for humans; token ids are the contract, so ids the tokenizer lacks give ""."""
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(ids)
        except ValueError:
            return ""

    def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("model_path (string) is required")
        try:
            self.engine.update_weights_from_disk(path)
        except (OSError, ValueError) as exc:
            return {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def health_generate(self) -> None:
        row = RowSpec(prompt_ids=[0], sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        self.batcher.submit([row]).result(timeout=60)

    def model_info(self) -> dict[str, Any]:
        info = self.engine.model_info()
        return {"model_path": info["model_path"], "tokenizer_path": None, "is_generation": True, **info}

    def server_info(self) -> dict[str, Any]:
        host, port = self._httpd.server_address[:2]
        return {
            "model_path": self.engine.model_path,
            "host": host,
            "port": port,
            "served_by": "sapo_megatron.rollout.cpu_server",
            "enable_return_routed_experts": self.engine.is_moe,
            "max_running_requests": self.engine.max_batch_size,
            "weight_version": str(self.engine.weight_version),
        }


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


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    app: CPUServer


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        try:
            if path == "/health" and method == "GET":
                self._send(HTTPStatus.OK, b"")
            elif path == "/health_generate" and method == "GET":
                app.health_generate()
                self._send(HTTPStatus.OK, b"")
            elif path == "/get_model_info" and method == "GET":
                self._send_json(HTTPStatus.OK, app.model_info())
            elif path == "/get_server_info" and method == "GET":
                self._send_json(HTTPStatus.OK, app.server_info())
            elif path == "/flush_cache":
                app.engine.flush_cache()
                self._send(HTTPStatus.OK, b"Cache flushed.\n", "text/plain")
            elif path == "/generate" and method == "POST":
                self._send_json(HTTPStatus.OK, app.generate(self._body()))
            elif path == "/update_weights_from_disk" and method == "POST":
                reply = app.update_weights_from_disk(self._body())
                self._send_json(HTTPStatus.OK if reply["success"] else HTTPStatus.BAD_REQUEST, reply)
            else:
                self._send_error(HTTPStatus.NOT_FOUND, f"no route {method} {path}")
        except BadRequest as exc:
            self._send_error(HTTPStatus.BAD_REQUEST, str(exc))
        except Exception as exc:
            if app.stopped:
                self.close_connection = True  # a stopped server answers nothing, like a crashed one
                return
            logger.exception("%s %s failed", method, path)
            self._send_error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as exc:
            raise BadRequest(f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _send_json(self, status: HTTPStatus, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send_error(self, status: HTTPStatus, message: str) -> None:
        self._send_json(status, {"error": {"message": message}})

    def _send(self, status: HTTPStatus, data: bytes, content_type: str = "text/plain") -> None:
        if self.server.app.stopped:
            self.close_connection = True
            return
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _load_tokenizer(model_dir: Path) -> Any:
    from sapo_megatron.data.tokenizer import TOKENIZER_FILE, CharTokenizer

    return CharTokenizer.load(model_dir) if (model_dir / TOKENIZER_FILE).is_file() else None


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    seed: int = 0,
    num_threads: int | None = None,
    block: bool = True,
) -> CPUServer:
    """Load ``model_dir`` and serve it. ``block=False`` returns the started server (stop it with ``.stop()``)."""
    engine = CPUEngine.from_pretrained(model_dir, seed=seed, num_threads=num_threads)
    server = CPUServer(engine, host=host, port=port, tokenizer=_load_tokenizer(Path(model_dir)))
    logger.info("serving %s at %s", model_dir, server.url)
    if not block:
        return server.start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Serve an HF causal LM on CPU with SGLang's native HTTP API subset"
    )
    parser.add_argument("--model", required=True, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for the forwards (default: torch's)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(args.model, args.host, args.port, seed=args.seed, num_threads=args.threads)


if __name__ == "__main__":
    main()
