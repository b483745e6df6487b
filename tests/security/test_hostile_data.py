"""Hostile prompt datasets (issue 30, area "datasets"): each file is read by the loader the trainer uses, and is
either read as documented (OK) or refused with one line that names the file, the row and what to fix (CLEAR)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sapo_megatron.data.datasets import DatasetKeys, read_dataset
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.data.render import PromptRenderer, apply_length_policy
from sapo_megatron.data.tokenizer import CharTokenizer
from tests.data.chat_fixtures import verl_records
from tests.security.hostile import case, expect

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

AREA = "datasets"
USER = {"role": "user", "content": "What is 1+1?"}


def jsonl(path: Path, *rows: object, text: str | None = None) -> Path:
    path.write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return path


def plain(prompt: object, label: object = "2", **extra: object) -> dict:
    return {"prompt": prompt, "ground_truth": label, **extra}


def verl_prompt(*messages: dict) -> dict:
    return {**verl_records(1)[0], "prompt": list(messages)}


def parquet(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


# Each builder writes the case's file(s) under tmp and returns (the source to load, the keys).
BUILDERS = {
    "role": lambda t: (jsonl(t / "a.jsonl", verl_prompt({"role": "wizard", "content": "hi"}, USER)), {}),
    "assistant only": lambda t: (
        jsonl(t / "a.jsonl", verl_prompt({"role": "assistant", "content": "4"})),
        {},
    ),
    "user assistant": lambda t: (
        jsonl(t / "a.jsonl", verl_prompt(USER, {"role": "assistant", "content": "2"})),
        {},
    ),
    "system only": lambda t: (
        jsonl(t / "a.jsonl", verl_prompt({"role": "system", "content": "Be brief."})),
        {},
    ),
    "content int": lambda t: (jsonl(t / "a.jsonl", verl_prompt({"role": "user", "content": 7})), {}),
    "content list": lambda t: (
        jsonl(t / "a.jsonl", verl_prompt({"role": "user", "content": [{"type": "text", "text": "hi"}]})),
        {},
    ),
    "json nan": lambda t: (jsonl(t / "a.jsonl", text='{"prompt": "1+1=", "ground_truth": NaN}\n'), {}),
    "json inf": lambda t: (jsonl(t / "a.jsonl", text='{"prompt": "1+1=", "ground_truth": Infinity}\n'), {}),
    "parquet nan": lambda t: (
        parquet(t / "a.parquet", {"prompt": ["a", "b"], "ground_truth": [2.5, float("nan")]}),
        {},
    ),
    "parquet int nan": lambda t: (
        parquet(t / "a.parquet", {"prompt": ["a", "b", "c"], "ground_truth": [1.0, float("nan"), 3.0]}),
        {},
    ),
    "null label": lambda t: (jsonl(t / "a.jsonl", plain("1+1=", None)), {}),
    "bool label": lambda t: (jsonl(t / "a.jsonl", plain("1+1=", True)), {}),
    "big row": lambda t: (jsonl(t / "a.jsonl", plain("1" * 10_000_000)), {}),
    "wrong keys": lambda t: (jsonl(t / "a.jsonl", {"question": "1+1=", "answer": "2"}), {}),
    "verl typo": lambda t: (
        jsonl(t / "a.jsonl", {**verl_records(1)[0], "reward_model": {"groundtruth": "1"}}),
        {},
    ),
    "verl typo verl": lambda t: (
        jsonl(t / "a.jsonl", {**verl_records(1)[0], "reward_model": {"groundtruth": "1"}}),
        {"format": "verl"},
    ),
    "verl + plain": lambda t: (
        _shards(t, pa.Table.from_pylist(verl_records(2)), jsonl(t / "d" / "b.jsonl", plain("1+1="))),
        {},
    ),
    "verl + slime": lambda t: (
        _shards(
            t,
            pa.Table.from_pylist(verl_records(2)),
            jsonl(t / "d" / "b.jsonl", {"input": "1+1=", "label": "2"}),
        ),
        {},
    ),
    "empty shard": lambda t: (
        _shards(t, pa.Table.from_pylist(verl_records(2)), jsonl(t / "d" / "b.jsonl", text="")),
        {},
    ),
    "0-row parquet": lambda t: (
        _shards(
            t,
            pa.Table.from_pylist(verl_records(2)),
            parquet(t / "d" / "b.parquet", {"prompt": pa.array([], pa.string())}),
        ),
        {},
    ),
    "glob": lambda t: (str(t / "*.parquet"), {}),
    "dir self-link": lambda t: (_self_linked_dir(t), {}),
    "self link": lambda t: (_self_link(t / "loop.jsonl"), {}),
    "jsonl.gz": lambda t: (_gz(t / "a.jsonl.gz"), {}),
    "dir of gz": lambda t: (_gz(t / "d" / "a.jsonl.gz").parent, {}),
    "gzip named jsonl": lambda t: (_gz(t / "a.jsonl"), {}),
    "bom": lambda t: (
        _bytes(t / "a.jsonl", b"\xef\xbb\xbf" + json.dumps(plain("1+1=")).encode() + b"\n"),
        {},
    ),
    "crlf": lambda t: (_bytes(t / "a.jsonl", (json.dumps(plain("1+1=")) + "\r\n").encode() * 2), {}),
    "utf16": lambda t: (_bytes(t / "a.jsonl", (json.dumps(plain("1+1=")) + "\n").encode("utf-16")), {}),
    "json array": lambda t: (
        _bytes(t / "a.json", json.dumps([plain("1+1="), plain("2+2=", "4")]).encode()),
        {},
    ),
    "torn": lambda t: (jsonl(t / "a.jsonl", text=json.dumps(plain("1+1=")) + '\n{"prompt": "2+'), {}),
    "truncated parquet": lambda t: (_truncated_parquet(t / "a.parquet"), {}),
    "json string prompt": lambda t: (
        parquet(t / "a.parquet", {"prompt": [json.dumps([USER])], "ground_truth": ["2"]}),
        {},
    ),
    "100k messages": lambda t: (jsonl(t / "a.jsonl", verl_prompt(*[USER] * 100_000)), {}),
    "int source": lambda t: (jsonl(t / "a.jsonl", plain("1+1=", domain=3)), {}),
    "flat dotted": lambda t: (
        jsonl(t / "a.jsonl", {"prompt": "1+1=", "reward_model.ground_truth": "2", "data_source": "x"}),
        {"format": "verl"},
    ),
    "dict prompt": lambda t: (jsonl(t / "a.jsonl", plain({"role": "user", "content": "hi"})), {}),
    "deep": lambda t: (
        jsonl(
            t / "a.jsonl",
            text='{"prompt": "1+1=", "ground_truth": "2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        ),
        {},
    ),
}


def _shards(tmp: Path, table, second: Path) -> Path:
    pq.write_table(table, tmp / "d" / "a.parquet")
    return second.parent


def _self_linked_dir(tmp: Path) -> Path:
    (tmp / "d").mkdir(exist_ok=True)
    jsonl(tmp / "d" / "a.jsonl", plain("1+1="))
    (tmp / "d" / "self").symlink_to(tmp / "d")
    return tmp / "d"


def _self_link(path: Path) -> Path:
    path.symlink_to(path)
    return path


def _gz(path: Path) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(gzip.compress((json.dumps(plain("1+1=")) + "\n").encode()))
    return path


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _truncated_parquet(path: Path) -> Path:
    parquet(path, {"prompt": ["a"] * 100, "ground_truth": ["1"] * 100})
    path.write_bytes(path.read_bytes()[:-40])
    return path


@pytest.mark.parametrize(
    ("cls", "builder", "words"),
    [
        case(
            AREA,
            'verl role "wizard"',
            "CLEAR",
            "role",
            "message 0 has role 'wizard'; a role is one of system",
        ),
        case(AREA, "non-string message content", "CLEAR", "content int", "string 'role' and 'content'"),
        case(AREA, "list (multimodal) content", "CLEAR", "content list", "string 'role' and 'content'"),
        case(AREA, "prompt = only an assistant message", "CLEAR", "assistant only", "has no user message"),
        case(AREA, "prompt = [user, assistant] (assistant dropped, documented)", "OK", "user assistant", ""),
        case(
            AREA,
            "prompt = only a system message",
            "CLEAR",
            "system only",
            "has no user message (roles: system)",
        ),
        case(
            AREA,
            "JSON NaN label, numeric_match",
            "CLEAR",
            "json nan",
            "a.jsonl:1: field 'ground_truth' (the label) is nan",
        ),
        case(AREA, "JSON Infinity label, numeric_match", "CLEAR", "json inf", "(the label) is inf"),
        case(
            AREA,
            "parquet NaN label, numeric_match",
            "CLEAR",
            "parquet nan",
            "a.parquet row 1: field 'ground_truth'",
        ),
        case(
            AREA,
            'parquet float/NaN labels, exact_match ("nan", "1.0")',
            "CLEAR",
            "parquet int nan",
            "a.parquet row 1: field 'ground_truth' (the label) must be a string",
        ),
        case(AREA, "null label", "CLEAR", "null label", "got NoneType"),
        case(AREA, "bool label", "CLEAR", "bool label", "got bool"),
        case(AREA, "wrong key names (question/answer)", "CLEAR", "wrong keys", "fields: answer, question"),
        case(AREA, "verl typo groundtruth (auto)", "CLEAR", "verl typo", "cannot tell the file's format"),
        case(
            AREA,
            "verl typo groundtruth (format=verl)",
            "CLEAR",
            "verl typo verl",
            "missing field 'reward_model.ground_truth'",
        ),
        case(AREA, "verl parquet + plain jsonl shards", "OK", "verl + plain", ""),
        case(
            AREA,
            "verl parquet + slime jsonl shards",
            "CLEAR",
            "verl + slime",
            "b.jsonl:1: cannot tell the file's format",
        ),
        case(AREA, "empty jsonl shard", "CLEAR", "empty shard", "b.jsonl: no rows"),
        case(AREA, "0-row parquet shard", "CLEAR", "0-row parquet", "b.parquet: no rows"),
        case(AREA, "glob matching nothing", "CLEAR", "glob", "the pattern matches no file"),
        case(AREA, "dir with self-symlink", "OK", "dir self-link", ""),
        case(AREA, "self-referential symlink file", "CLEAR", "self link", "a symbolic link that loops"),
        case(AREA, ".jsonl.gz file", "CLEAR", "jsonl.gz", "unknown prompt file type '.gz'"),
        case(
            AREA,
            "dir of only .jsonl.gz",
            "CLEAR",
            "dir of gz",
            "1 compressed file(s), such as a.jsonl.gz: decompress",
        ),
        case(
            AREA,
            "gzip content named .jsonl",
            "CLEAR",
            "gzip named jsonl",
            "a.jsonl: the file is gzip-compressed",
        ),
        case(AREA, "UTF-8 BOM jsonl", "CLEAR", "bom", "a.jsonl:1: invalid JSON (Unexpected UTF-8 BOM"),
        case(AREA, "CRLF jsonl", "OK", "crlf", ""),
        case(AREA, "UTF-16 jsonl", "CLEAR", "utf16", "a.jsonl:1: not UTF-8 text"),
        case(AREA, ".json top-level array", "OK", "json array", ""),
        case(AREA, "torn last jsonl line", "CLEAR", "torn", "a.jsonl:2: invalid JSON"),
        case(AREA, "truncated parquet", "CLEAR", "truncated parquet", "a.parquet: cannot read parquet"),
        case(AREA, "prompt stored as JSON string of messages", "OK", "json string prompt", ""),
        case(AREA, "int data_source", "CLEAR", "int source", "field 'domain' (the source) must be a string"),
        case(AREA, "flat column named reward_model.ground_truth", "OK", "flat dotted", ""),
        case(AREA, "dict prompt", "CLEAR", "dict prompt", "must be a string or a non-empty list"),
        case(AREA, "100k-deep nested JSON row", "CLEAR", "deep", "a.jsonl:1: the JSON is nested too deeply"),
    ],
)
def test_hostile_datasets(tmp_path, cls, builder, words):
    (tmp_path / "d").mkdir()
    source, keys = BUILDERS[builder](tmp_path)
    dataset = expect(cls, lambda: read_dataset(source, DatasetKeys(**keys)), words)
    if cls == "OK":
        assert dataset.rows and all(row.ground_truth for row in dataset.rows)
        OK_CHECKS.get(builder, lambda rows: None)(dataset.rows)


OK_CHECKS = {
    "user assistant": lambda rows: _assert(rows[0].prompt == [USER, {"role": "assistant", "content": "2"}]),
    "verl + plain": lambda rows: _assert(len(rows) == 3 and rows[-1].prompt == "1+1="),
    "dir self-link": lambda rows: _assert(len(rows) == 1),
    "crlf": lambda rows: _assert([r.prompt for r in rows] == ["1+1=", "1+1="]),
    "json array": lambda rows: _assert([r.ground_truth for r in rows] == ["2", "4"]),
    "json string prompt": lambda rows: _assert(rows[0].prompt == [USER]),
    "flat dotted": lambda rows: _assert(rows[0].ground_truth == "2"),
}


def _assert(condition: bool) -> None:
    assert condition


def test_float_columns_keep_their_values_and_int_columns_with_gaps_their_ints(tmp_path):
    floats = read_dataset(
        parquet(tmp_path / "f.parquet", {"prompt": ["a", "b"], "ground_truth": [2.5, 1.0]}), DatasetKeys()
    )
    assert [row.ground_truth for row in floats.rows] == ["2.5", "1.0"]  # a float column as given
    ints = parquet(
        tmp_path / "i.parquet", {"prompt": ["a", "b"], "ground_truth": [1.0, float("nan")], "x": [1, 2]}
    )
    keys = DatasetKeys(label_key="x")
    assert [row.ground_truth for row in read_dataset(ints, keys).rows] == ["1", "2"]


@pytest.mark.parametrize(
    ("cls", "builder", "words"),
    [
        case(AREA, "10 MB single row", "CLEAR", "big row", "tokens, over data.max_prompt_tokens=4096"),
        case(
            AREA,
            "100k messages in one prompt",
            "CLEAR",
            "100k messages",
            "a prompt of chat messages needs a chat template",
        ),
    ],
)
def test_huge_prompts_stop_at_the_length_policy(tmp_path, cls, builder, words):
    (tmp_path / "d").mkdir()
    source, keys = BUILDERS[builder](tmp_path)
    keys = DatasetKeys(max_prompt_tokens=4096, **keys)
    rows = read_dataset(source, keys).rows
    expect(
        cls,
        lambda: apply_length_policy(rows, PromptRenderer(CharTokenizer(), keys), keys, str(source)),
        words,
    )
    assert isinstance(rows[0], PromptRow)
