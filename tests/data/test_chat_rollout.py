"""The ids a rollout engine receives are transformers' own ``apply_chat_template`` ids, for a verl parquet, a slime
jsonl with its own keys and a plain jsonl, through the run's data path (``build_run_data``) and the trainer's
``collect`` call: with the in-process CPU engine and with the served one (CPU server over HTTP, SGLang's API).
Also: MOPD domains come from ``data_source``; ``serve`` loads the model folder's HF tokenizer; samples.jsonl."""

from __future__ import annotations

import json
import types

import httpx
import pytest

from sapo_megatron.algo import AdvantageConfig
from sapo_megatron.config import config_from_dict
from sapo_megatron.data.loading import build_run_data
from sapo_megatron.data.samples import SAMPLES_FILE, SampleLog, resume_point
from sapo_megatron.distill.config import (
    DistillConfigError,
    TeacherConfig,
    check_domains_served,
    prompt_domains,
)
from sapo_megatron.loop.in_flight import IN_FLIGHT_FILE, holds_batch_in_flight
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from sapo_megatron.rollout.collect import CollectSettings, collect
from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.cpu.server import CPUServer, serve
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.types import SamplingParams
from sapo_megatron.runtime.tracking import Tracker
from tests.data.chat_fixtures import (
    make_chat_tokenizer,
    plain_records,
    slime_records,
    write_jsonl,
    write_verl_parquet,
)

pytest.importorskip("pyarrow")
KWARGS = {"enable_thinking": False}
SOURCES = {
    "verl": {},
    "slime": {"format": "slime", "prompt_key": "question", "label_key": "answer"},
    "plain": {},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny dense Qwen3 whose vocabulary covers the BPE tokenizer saved beside it (a model folder)."""
    path = tmp_path_factory.mktemp("chat_model")
    make_tiny_hf_checkpoint(path, "dense", vocab_size=384)
    make_chat_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def run_data(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_data")
    files = {
        "verl": write_verl_parquet(root / "train.parquet", 6),
        "slime": write_jsonl(root / "slime.jsonl", slime_records(4)),
        "plain": write_jsonl(root / "plain.jsonl", plain_records(4)),
    }
    built = {}
    for name, path in files.items():
        data = {
            "train": str(path),
            "tokenizer": str(model_dir),
            "apply_chat_template": True,
            "chat_template_kwargs": KWARGS,
            **SOURCES[name],
        }
        cfg = config_from_dict(
            {"model": {"hf_config": str(model_dir)}, "rollout": {"max_new_tokens": 16}, "data": data}
        )
        built[name] = build_run_data(cfg, log=lambda line: None)
    return built


def reference_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **KWARGS)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def expected_ids(data) -> list[list[int]]:
    """transformers' ids for each row: verl rows are messages already, the others one user message."""
    out = []
    for row in data.train_rows:
        messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
        out.append(reference_ids(data.tokenizer, messages))
    return out


def recording(target: object, method: str = "generate_rows") -> list[list[int]]:
    """Record the prompt ids of every row ``target.method`` receives (an engine's ``generate_rows``, a server's
    batcher's ``submit``)."""
    received: list[list[int]] = []
    original = getattr(target, method)

    def record(rows, *args, **kwargs):
        received.extend(list(row.prompt_ids) for row in rows)
        return original(rows, *args, **kwargs)

    setattr(target, method, record)
    return received


def rollout(engine, data):
    """The trainer's rollout call: ``collect`` with the run's renderer as the prompt encoder."""
    settings = CollectSettings(
        n_samples=2,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(data.tokenizer.eos_id,)),
        advantage=AdvantageConfig(),
    )
    return collect(
        engine,
        data.train_rows,
        refill=lambda n: [],
        encode=data.renderer.encode,
        score=lambda sample, row: float(len(sample.response_ids) % 2),
        settings=settings,
        seed=1,
    )


@pytest.mark.parametrize("name", list(SOURCES))
def test_engines_receive_the_chat_template_ids(run_data, model_dir, name, tmp_path):
    data = run_data[name]
    expected = expected_ids(data)
    assert len({tuple(ids) for ids in expected}) == len(expected)  # the rows do differ
    engine = CPUEngine.from_pretrained(model_dir, seed=0, num_threads=1)
    received = recording(engine)
    batch = rollout(engine, data)
    assert received == [ids for ids in expected for _ in range(2)]  # n=2 samples of each prompt
    assert [s.prompt_ids for s in batch.samples] == [ids for ids in expected for _ in range(2)]
    with CPUServer(CPUEngine.from_pretrained(model_dir, seed=0, num_threads=1)).start() as server:
        served = recording(server.batcher, "submit")
        rollout(SGLangClient([server.url]), data)
    assert sorted(served) == sorted(ids for ids in expected for _ in range(2))  # HTTP: any arrival order
    if (
        name == "plain"
    ):  # samples.jsonl rows of this batch: the prompt as the engine saw it, special tokens kept
        rows = SampleLog(tmp_path, every=1, tokenizer=data.tokenizer, enabled=True).record(1, batch)
        assert rows[0]["prompt"] == data.tokenizer.decode(expected[0], skip_special_tokens=False)
        assert rows[0]["prompt"].startswith("<|im_start|>user\nWhat is 0 plus 30?<|im_end|>")
        assert {r["source"] for r in rows} == {"addition"} and len(rows) == 4
        assert rows[0]["response_tokens"] == len(batch.groups[0][0].response_ids)
        assert rows[0]["reward"] == float(batch.rewards[0, 0])


def test_mopd_domains_come_from_data_source(run_data):
    rows = run_data["verl"].train_rows
    assert prompt_domains(rows) == ["aime", "deepmath"]
    teachers = [TeacherConfig(name="math", model_path="m", domains=["deepmath"])]
    with pytest.raises(DistillConfigError, match="row 1: no teacher serves its domain 'aime'"):
        check_domains_served(teachers, rows, "train.parquet")
    both = [*teachers, TeacherConfig(name="comp", model_path="c", domains=["aime"])]
    check_domains_served(both, rows, "train.parquet")


def test_samples_file_every_n_steps_and_resume_truncation(tmp_path, run_data, model_dir):
    data = run_data["verl"]
    engine = CPUEngine.from_pretrained(model_dir, seed=0, num_threads=1)
    batch = rollout(engine, data)
    tracker = Tracker(tmp_path, enabled=True)
    log = SampleLog(tmp_path, every=2, tokenizer=data.tokenizer, enabled=True, tracker=tracker)
    for step in range(1, 7):
        log.record(step, batch)
    tracker.close()
    assert list((tmp_path / "tensorboard" / "rl").glob("events.out.tfevents.*"))  # a few as TensorBoard text
    rows = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 4 + [4] * 4 + [6] * 4
    assert {r["source"] for r in rows} == {"deepmath", "aime"}
    assert set(rows[0]) >= {
        "step",
        "prompt",
        "response",
        "reward",
        "source",
        "finish_reason",
        "response_tokens",
    }
    SampleLog(tmp_path, every=2, tokenizer=data.tokenizer, enabled=True, resume_at={"rl": 4})
    rows = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 4 + [4] * 4  # a resume from step 4 drops what came after
    with_batch = tmp_path / "ckpt"  # a checkpoint that holds the batch in flight keeps that step's samples
    with_batch.mkdir()
    checkpoint = types.SimpleNamespace(path=with_batch, steps={"sft": 0, "rl": 2})
    in_flight = holds_batch_in_flight(checkpoint)
    assert not in_flight and resume_point(checkpoint, batch_in_flight=in_flight) == {"sft": 0, "rl": 2}
    assert resume_point(None) is None
    (with_batch / IN_FLIGHT_FILE).write_bytes(b"")
    in_flight = holds_batch_in_flight(checkpoint)
    assert in_flight and resume_point(checkpoint, batch_in_flight=in_flight) == {"sft": 0, "rl": 3}
    off = SampleLog(tmp_path / "off", every=0, tokenizer=data.tokenizer, enabled=True)
    assert off.record(10, batch) == [] and not (tmp_path / "off" / SAMPLES_FILE).exists()


def test_serve_loads_the_model_folders_hf_tokenizer(model_dir, run_data):
    tokenizer = run_data["verl"].tokenizer
    server = serve(model_dir, port=0, block=False, num_threads=1)
    try:
        text = run_data["verl"].renderer.text(run_data["verl"].train_rows[0])
        body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        reply = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        assert reply["meta_info"]["prompt_tokens"] == len(expected_ids(run_data["verl"])[0])
        assert reply["text"] == tokenizer.decode(reply["output_ids"]) and len(reply["output_ids"]) >= 1
        batch = httpx.post(
            server.url + "/generate", json={**body, "text": [text, "What is"]}, timeout=60
        ).json()
        assert [r["meta_info"]["prompt_tokens"] for r in batch] == [
            len(expected_ids(run_data["verl"])[0]),
            len(tokenizer.hf("What is")["input_ids"]),
        ]
        assert httpx.get(server.url + "/get_model_info", timeout=30).json()["tokenizer_path"] == str(
            model_dir
        )
        both = httpx.post(server.url + "/generate", json={**body, "input_ids": [1, 2]}, timeout=30)
        assert both.status_code == 400 and "either text or input_ids" in both.json()["error"]["message"]
    finally:
        server.stop()
