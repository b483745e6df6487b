"""Remote rewards: batches of samples POSTed as JSON to a reward server, with retries and timeouts.

Protocol (version 1):

- request: ``POST <url>`` with ``Content-Type: application/json`` and, when ``api_key_env`` names a set
  environment variable, ``Authorization: Bearer <its value>``; body
  ``{"samples": [{"response", "label", "prompt", "source", "metadata", "group_id"}, ...]}``
  (at most ``batch_size`` samples per request, in order);
- response: HTTP 200 with ``{"scores": [s_0, s_1, ...]}``, one per sample, in order, each a number or an object
  with ``score`` and any other fields (logged, like a local reward's dict); or ``{"error": "..."}`` with a 4xx;
- HTTP 429, 5xx, connection errors and timeouts (``timeout_s`` per request) are retried up to ``max_retries``
  times with exponential backoff (0.5 s, 1 s, 2 s, ... capped at 10 s); other 4xx are not retried. A batch that
  still fails scores 0.0 for each of its samples with the error (``algorithm.max_reward_error_frac`` applies).
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from sapo_megatron.rewards.outputs import error_output, to_output
from sapo_megatron.rewards.types import RewardInput, RewardOutput

logger = logging.getLogger(__name__)
_RETRY_STATUS = {429, 500, 502, 503, 504}


@dataclass(frozen=True)
class RemoteSettings:
    url: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    max_retries: int = 3
    batch_size: int = 256


class RemoteRewardError(RuntimeError):
    """A request failed for good (after the retries, or with a status that is not retried)."""


class RemoteReward:
    """Scores batches through the protocol in the module docstring; ``retries`` counts the run's retries."""

    def __init__(self, settings: RemoteSettings, *, backoff_s: float = 0.5) -> None:
        self.settings, self.backoff_s = settings, backoff_s
        self.retries = 0

    def run(self, units: list[list[RewardInput]]) -> list[list[RewardOutput]]:
        flat = [item for unit in units for item in unit]
        scored: list[RewardOutput] = []
        size = self.settings.batch_size
        for start in range(0, len(flat), size):
            scored += self._score_batch(flat[start : start + size])
        out, at = [], 0
        for unit in units:
            out.append(scored[at : at + len(unit)])
            at += len(unit)
        return out

    def _score_batch(self, batch: list[RewardInput]) -> list[RewardOutput]:
        try:
            scores = self._post({"samples": [item.as_dict() for item in batch]})
        except RemoteRewardError as exc:
            return [RewardOutput(0.0, {}, str(exc)) for _ in batch]
        if not isinstance(scores, list) or len(scores) != len(batch):
            got = len(scores) if isinstance(scores, list) else type(scores).__name__
            return [RewardOutput(0.0, {}, f"reward server returned {got} scores for {len(batch)}")] * len(
                batch
            )
        outputs = []
        for value in scores:
            try:
                outputs.append(to_output(value))
            except Exception as exc:
                outputs.append(error_output(exc))
        return outputs

    def _post(self, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.settings.api_key_env or "") if self.settings.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        last = ""
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                self.retries += 1
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 10.0))
            request = urllib.request.Request(self.settings.url, data=data, headers=headers, method="POST")
            try:
                return _scores(self._exchange(request))
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {_body(exc)}{self._status_hint(exc.code, exc.headers)}"
                if exc.code not in _RETRY_STATUS:
                    break
            except _BadReply as exc:  # the server answered, wrongly: asking again gets the same answer
                last = str(exc)
                break
            except (OSError, ValueError) as exc:  # URLError, timeouts, resets
                last = f"{type(exc).__name__}: {exc}"
            logger.warning("reward server %s: %s (attempt %d)", self.settings.url, last, attempt + 1)
        raise RemoteRewardError(f"reward server {self.settings.url} failed: {last}")

    def _exchange(self, request: urllib.request.Request) -> bytes:
        """The reply body, read within ``timeout_s`` of wall-clock time in all (a server that drips a byte at a
        time cannot stretch it) and at most :data:`MAX_REPLY_BYTES` long; redirects are not followed."""
        deadline = time.monotonic() + self.settings.timeout_s
        with _OPENER.open(request, timeout=self.settings.timeout_s) as reply:
            chunks, total = [], 0
            while chunk := reply.read1(1 << 16):
                total += len(chunk)
                if total > MAX_REPLY_BYTES:
                    raise _BadReply(f"the reply is larger than {MAX_REPLY_BYTES} bytes (the limit)")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the reply took longer than timeout_s={self.settings.timeout_s:g} s")
                chunks.append(chunk)
            body = b"".join(chunks)
            kind = reply.headers.get("Content-Type", "")
        if "json" not in kind and not body.lstrip().startswith((b"{", b"[")):
            raise _BadReply(f"HTTP 200 with {kind or 'no Content-Type'}, not JSON: {body[:80]!r}")
        return body

    def _status_hint(self, code: int, headers: Any) -> str:
        if code in (301, 302, 303, 307, 308):
            return f" (a redirect to {headers.get('Location')!r}: give that URL as algorithm.reward.url)"
        if code in (401, 403):
            env = self.settings.api_key_env
            if not env:
                return " (the server wants a key: set algorithm.reward.api_key_env to the variable that holds it)"
            if not os.environ.get(env):
                return f" (the key variable {env} is not set in this environment)"
            return f" (the server refused the key in {env})"
        return ""

    def close(self) -> None:
        pass


MAX_REPLY_BYTES = 64 << 20
"""The largest reply read from a reward server (a batch of 256 scores with fields is well under 1 MB)."""


class _BadReply(ValueError):
    """The server answered, but not with the protocol's reply."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 3xx reaches the caller as an HTTPError that names the new location


_OPENER = urllib.request.build_opener(_NoRedirect)


def _scores(body: bytes) -> Any:
    try:
        reply = json.loads(body)
    except (ValueError, RecursionError):
        raise _BadReply(f"the reply is not valid JSON: {body[:80]!r}") from None
    if not isinstance(reply, dict) or "scores" not in reply:
        raise _BadReply(f"the reply has no 'scores' (protocol: {{\"scores\": [...]}}): {body[:80]!r}")
    return reply["scores"]


def _body(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(300).decode(errors="replace").strip()
    except Exception:
        return ""
