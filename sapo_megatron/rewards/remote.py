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
                with urllib.request.urlopen(request, timeout=self.settings.timeout_s) as reply:
                    return json.loads(reply.read())["scores"]
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {_body(exc)}"
                if exc.code not in _RETRY_STATUS:
                    break
            except (OSError, ValueError, KeyError) as exc:  # URLError, timeouts, resets, bad JSON
                last = f"{type(exc).__name__}: {exc}"
            logger.warning("reward server %s: %s (attempt %d)", self.settings.url, last, attempt + 1)
        raise RemoteRewardError(f"reward server {self.settings.url} failed: {last}")

    def close(self) -> None:
        pass


def _body(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(300).decode(errors="replace").strip()
    except Exception:
        return ""
