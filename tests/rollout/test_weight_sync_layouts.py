"""Weight sync from a sharded trainer: under PP2 each pipeline stage broadcasts its own layers from its own rank,
under EP2 expert shards reach the stage's source one bucket at a time, and the served model then equals the
trainer's weights (a CPU server in another process, joined over gloo). Tensor mode hands buckets, never the whole
model at once."""

from __future__ import annotations

import numpy as np
import pytest

from sapo_megatron.checkpoint.mapping import hf_expected_shapes
from sapo_megatron.config import config_from_dict
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.distributed import run_distributed
from tests.rollout.server_process import ServerProcess
from tests.servers import local_logprobs, served_logprobs

PROBE = [3, 17, 5, 9, 40, 2, 8, 21]
BUCKET = 24 * 1024  # bytes: several buckets for the tiny model, a few tensors each


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    return {
        name: make_tiny_hf_checkpoint(root / name, "moe", seed=seed) for name, seed in (("a", 1), ("b", 2))
    }


def expected_names(hf_dir) -> set[str]:
    arch = config_from_dict({"model": {"hf_config": str(hf_dir)}}).model.arch
    return set(hf_expected_shapes(arch))


@pytest.mark.parametrize(
    ("parallel", "world"),
    [({"pp": 2}, 2), ({"ep": 2}, 2)],
    ids=["pp2", "ep2"],
)
def test_distributed_sync_from_every_stage(checkpoints, parallel, world):
    server = ServerProcess("--model-path", str(checkpoints["a"]), "--port", "0", "--threads", "1")
    try:
        payload = {"hf_dir": str(checkpoints["b"]), "parallel": parallel, "world": world}
        results = run_distributed(
            "tests.rollout.weight_sync_scenarios:distributed_push",
            world,
            {**payload, "url": server.url, "bucket_bytes": BUCKET},
        )
        served = served_logprobs(server.url, PROBE)
    finally:
        server.stop()
    reference = local_logprobs(checkpoints["b"], PROBE)
    assert np.abs(served - reference).max() < 1e-5  # the server now holds the trainer's weights
    names = [{name for bucket in r["sent"][: len(r["sent"]) // 2] for name, _ in bucket} for r in results]
    assert set().union(*names) == expected_names(checkpoints["b"])  # every tensor sent ...
    assert sum(len(n) for n in names) == len(expected_names(checkpoints["b"]))  # ... once per push
    for result in results:
        largest = max(sum(size for _, size in bucket) for bucket in result["sent"]) if result["sent"] else 0
        assert largest <= BUCKET or all(len(b) == 1 for b in result["sent"] if sum(s for _, s in b) > BUCKET)
    if "pp" in parallel:  # each stage sent its own layers from its own rank
        by_stage = {r["pp_rank"]: names[i] for i, r in enumerate(results)}
        assert all(".layers.0." in n or "embed_tokens" in n for n in by_stage[0])
        assert all(".layers.1." in n or n in ("model.norm.weight", "lm_head.weight") for n in by_stage[1])
    else:  # one stage: rank 0 is its source; rank 1's experts came to it bucket by bucket
        assert names[1] == set() and results[0]["metrics"][0]["weight_sync/version"] == 1.0


def test_tensor_sync_hands_buckets(checkpoints):
    payload = {"hf_dir": str(checkpoints["b"]), "parallel": {"ep": 2}, "world": 2, "bucket_bytes": BUCKET}
    main, other = run_distributed("tests.rollout.weight_sync_scenarios:tensor_push", 2, payload)
    sizes = [sum(size for _, size in bucket) for bucket in main["buckets"]]
    assert len(sizes) > 3 and max(sizes) <= BUCKET  # never the whole model in one call
    assert {name for bucket in main["buckets"] for name, _ in bucket} == expected_names(checkpoints["b"])
    assert main["finished"] == 1 and other["buckets"] is None
