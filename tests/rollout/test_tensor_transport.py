"""serialize_named_tensors / deserialize_named_tensors: SGLang's wire format, restricted reading, who can open it."""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing

from sapo_megatron.rollout.tensor_transport import (
    TensorTransportError,
    deserialize_flattened_bucket,
    deserialize_named_tensors,
    flattened_buckets,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from tests.rollout.server_process import child_env

RECEIVER = """
import sys
from sapo_megatron.rollout.tensor_transport import TensorTransportError, deserialize_named_tensors
for line in sys.stdin:
    try:
        named = deserialize_named_tensors(line.strip(), allowed_pids=[int(sys.argv[1])])
        print("ok", named[0][0], float(named[0][1].sum()), flush=True)
    except TensorTransportError as exc:
        print("refused", str(exc).replace(chr(10), " "), flush=True)
"""


def sample_named() -> list[tuple[str, torch.Tensor]]:
    return [
        ("model.embed_tokens.weight", torch.arange(12.0).reshape(3, 4)),
        ("lm_head.weight", torch.full((2, 2), 0.5, dtype=torch.bfloat16)),
        ("param", torch.nn.Parameter(torch.tensor([1.0, -2.0]))),
        ("strided", torch.arange(16.0).reshape(4, 4)[:, 1]),
    ]


def test_round_trip_in_one_process_keeps_names_values_and_dtypes():
    named = sample_named()
    received = deserialize_named_tensors(serialize_named_tensors(named))
    assert [name for name, _ in received] == [name for name, _ in named]
    for (_, sent), (_, got) in zip(named, received):
        assert got.dtype == sent.dtype and torch.equal(got, sent.detach())


def test_wire_format_is_sglangs_base64_of_a_forking_pickle():
    named = sample_named()[:2]
    text = serialize_named_tensors(named)
    # What SGLang's MultiprocessingSerializer.deserialize does (base64, validate=True; then a ForkingPickle load).
    loaded = pickle.loads(base64.b64decode(text, validate=True))
    assert [n for n, _ in loaded] == [n for n, _ in named] and torch.equal(loaded[0][1], named[0][1])
    # What MultiprocessingSerializer.serialize(obj, output_str=True) produces is read here too, str or bytes.
    for as_text in (True, False):
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(named)  # a fresh dump each time: a handle can be opened once
        payload = base64.b64encode(buffer.getvalue()).decode() if as_text else buffer.getvalue()
        (name, tensor), _ = deserialize_named_tensors(payload)
        assert name == "model.embed_tokens.weight" and torch.equal(tensor, named[0][1])


def test_a_payload_is_read_once():
    text = serialize_named_tensors([("w", torch.ones(2))])
    assert torch.equal(deserialize_named_tensors(text)[0][1], torch.ones(2))
    with pytest.raises(TensorTransportError, match="can be read once"):
        deserialize_named_tensors(text)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class _FakeCudaHandle:
    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return (rebuild_cuda_tensor, ())


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (base64.b64encode(pickle.dumps([("x", _Evil())])).decode(), "system, which is not allowed"),
        (base64.b64encode(pickle.dumps([("x", _FakeCudaHandle())])).decode(), "CUDA"),
        ("not base64 !", "not valid base64"),
        (base64.b64encode(pickle.dumps({"x": 1})).decode(), "list of (name, tensor) pairs"),
        (base64.b64encode(pickle.dumps([("x", 3)])).decode(), "(name, tensor) pairs"),
        (base64.b64encode(b"garbage").decode(), "not a tensor payload"),
    ],
)
def test_refuses_what_is_not_a_cpu_tensor_payload(payload, words):
    with pytest.raises(TensorTransportError, match=words.replace("(", r"\(").replace(")", r"\)")):
        deserialize_named_tensors(payload)


@pytest.mark.slow
def test_another_process_opens_file_system_handles_and_explains_file_descriptor_ones():
    by_fd = serialize_named_tensors([("w", torch.ones(4))])  # torch's default strategy: file_descriptor
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        kept = [("w", torch.full((4,), 2.0))]  # alive until the receiver has answered
        by_name = serialize_named_tensors(kept)
        receiver = subprocess.run(
            [sys.executable, "-c", RECEIVER, str(os.getpid())],  # the sender's pid: its names may open
            input=f"{by_fd}\n{by_name}\n",
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
        )
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    lines = receiver.stdout.splitlines()
    assert len(lines) == 2, receiver.stderr[-2000:]
    assert lines[0].startswith("refused") and "set_sharing_strategy('file_system')" in lines[0]
    assert lines[1] == "ok w 8.0"


def test_flattened_buckets_one_per_dtype_in_fresh_buffers_round_trip():
    named = [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.ones(4, dtype=torch.bfloat16)),
        ("c", torch.full((5,), 2.5)),
    ]
    buckets = flattened_buckets(named)
    assert [[m.name for m in b["metadata"]] for b in buckets] == [["a", "c"], ["b"]]
    assert all(
        b["flattened_tensor"].untyped_storage().data_ptr() != named[0][1].untyped_storage().data_ptr()
        for b in buckets
    )
    received = dict(
        pair for b in buckets for pair in deserialize_flattened_bucket(serialize_flattened_bucket(b))
    )
    for name, tensor in named:
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)


def _forged(bucket: dict) -> str:
    return serialize_flattened_bucket(bucket)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda b: b["metadata"][0].__dict__.update(end_idx=b["metadata"][0].end_idx + 4), "do not hold"),
        (lambda b: b["metadata"][1].__dict__.update(start_idx=0, end_idx=20), "do not hold"),
        (lambda b: b["metadata"].pop(), "covers 24 of its 44 bytes"),
        (lambda b: b.update(extra=1), "a flattened bucket is"),
        (lambda b: b["metadata"][0].__dict__.update(dtype="float32"), "dtype a torch dtype"),
    ],
    ids=["overrun", "overlap", "uncovered", "extra-key", "dtype-string"],
)
def test_forged_flattened_metadata_is_refused_before_opening(edit, words):
    bucket = flattened_buckets([("a", torch.zeros(2, 3)), ("b", torch.zeros(5))])[0]
    edit(bucket)
    with pytest.raises(TensorTransportError, match=words):
        deserialize_flattened_bucket(_forged(bucket))


def test_flattened_bucket_refuses_other_classes():
    payload = base64.b64encode(pickle.dumps({"flattened_tensor": 1, "metadata": [os.system]})).decode()
    with pytest.raises(TensorTransportError, match="not allowed"):
        deserialize_flattened_bucket(payload)
