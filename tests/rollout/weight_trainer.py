"""A stand-in trainer process for the distributed weight-sync test (run as a script; prints one JSON report).

It owns a default process group (gloo, world 1) like a real trainer, joins the CPU server's weights update group as
rank 0 with :func:`init_custom_process_group`, and drives the server over HTTP the way the client does: POST the
request in the background, broadcast, then wait for the reply.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from sapo_megatron.rollout.weight_group import (
    WeightGroupError,
    broadcast_bucket,
    destroy_custom_process_group,
    init_custom_process_group,
    tensor_metadata,
)

GROUP = "wsync"


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The reply of a successful call; raises with the server's message otherwise (as the client does)."""
    reply = httpx.post(url + path, json=body, timeout=120)
    payload = reply.json()
    if reply.status_code != 200 or payload.get("success") is not True:
        raise RuntimeError(f"{path}: HTTP {reply.status_code}: {payload.get('message', payload)}")
    return payload


def init_body(port: int, world_size: int, group: str) -> dict[str, Any]:
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world_size,
        "group_name": group,
        "backend": "gloo",
    }


def join(pool: ThreadPoolExecutor, cfg: dict[str, Any]) -> dist.ProcessGroup:
    reply = pool.submit(post, cfg["url"], "/init_weights_update_group", init_body(cfg["port_a"], 2, GROUP))
    group = init_custom_process_group(
        "gloo", "127.0.0.1", cfg["port_a"], 2, 0, GROUP, timeout=cfg["timeout_s"]
    )
    reply.result(timeout=60)
    return group


def refused_requests(url: str) -> list[dict[str, Any]]:
    """Bad metadata: answered at once, before any broadcast."""
    cases = {
        "unknown_name": (["model.nope.weight"], ["float32"], [[2]]),
        "wrong_shape": (["model.embed_tokens.weight"], ["float32"], [[3, 3]]),
        "bad_dtype": (["model.norm.weight"], ["float33"], [[32]]),
    }
    results = []
    for case, (names, dtypes, shapes) in cases.items():
        started = time.monotonic()
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": GROUP}
        reply = httpx.post(url + "/update_weights_from_distributed", json=body, timeout=120)
        results.append(
            {
                "case": case,
                "status": reply.status_code,
                **reply.json(),
                "elapsed_s": time.monotonic() - started,
            }
        )
    return results


def update(pool: ThreadPoolExecutor, url: str, group: dist.ProcessGroup, weights: str) -> dict[str, Any]:
    named = sorted(load_file(weights).items())  # HF checkpoint names: per-expert weights, as on disk
    names, dtypes, shapes = tensor_metadata(named)
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": GROUP, "flush_cache": True}
    started = time.monotonic()
    reply = pool.submit(post, url, "/update_weights_from_distributed", body)
    broadcast_bucket(group, [tensor for _, tensor in named], reply=reply, timeout_s=120)
    return {**reply.result(timeout=120), "num_tensors": len(named), "elapsed_s": time.monotonic() - started}


def refused_while_broadcasting(
    pool: ThreadPoolExecutor, url: str, group: dist.ProcessGroup
) -> dict[str, Any]:
    """The server refuses; the trainer, already broadcasting, learns it from the reply instead of timing out."""
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[7]], "group_name": GROUP}
    started = time.monotonic()
    reply: Future = pool.submit(post, url, "/update_weights_from_distributed", body)
    try:
        broadcast_bucket(group, [torch.zeros(7)], reply=reply, timeout_s=120)
    except WeightGroupError as exc:
        return {"raised": True, "message": str(exc), "elapsed_s": time.monotonic() - started}
    return {"raised": False, "elapsed_s": time.monotonic() - started}


def default_group_intact() -> bool:
    value = torch.ones(3)
    dist.all_reduce(value)  # on the default group: still usable after the weights group came and went
    return dist.get_world_size() == 1 and bool(torch.equal(value, torch.ones(3)))


def wrong_world_size(pool: ThreadPoolExecutor, cfg: dict[str, Any]) -> dict[str, Any]:
    """Both sides say world_size 3, but only two processes exist: both give up after their timeouts."""
    started = time.monotonic()
    reply = pool.submit(post, cfg["url"], "/init_weights_update_group", init_body(cfg["port_b"], 3, "wsync3"))
    result: dict[str, Any] = {}
    try:
        init_custom_process_group(
            "gloo", "127.0.0.1", cfg["port_b"], 3, 0, "wsync3", timeout=cfg["timeout_s"]
        )
        result["trainer_error"] = None
    except WeightGroupError as exc:
        result["trainer_error"] = str(exc)
    result["trainer_elapsed_s"] = time.monotonic() - started
    try:
        reply.result(timeout=120)
        result["server_error"] = None
    except RuntimeError as exc:
        result["server_error"] = str(exc)
    result["server_elapsed_s"] = time.monotonic() - started
    return result


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    # The trainer's own default group (a store of its own: this process runs as if under torchrun, whose
    # TORCHELASTIC_USE_AGENT_STORE makes tcp:// rendezvous expect the agent's store, see run_trainer)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pool = ThreadPoolExecutor(max_workers=2)
    report: dict[str, Any] = {}
    group = join(pool, cfg)
    report["refused"] = refused_requests(cfg["url"])
    report["update"] = update(pool, cfg["url"], group, cfg["weights"])
    report["refused_while_broadcasting"] = refused_while_broadcasting(pool, cfg["url"], group)
    report["destroy"] = post(cfg["url"], "/destroy_weights_update_group", {"group_name": GROUP})
    destroy_custom_process_group(group)
    report["default_group_intact"] = default_group_intact()
    report["wrong_world_size"] = wrong_world_size(pool, cfg)
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
