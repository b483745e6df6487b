"""Prompt files (read as plain data: ``load_dataset`` with the default keys), the resumable iterator, the char tokenizer and the synthetic addition task."""

from __future__ import annotations

import json

import pytest

from sapo_megatron.data import (
    CharTokenizer,
    DatasetError,
    PromptIterator,
    PromptRow,
    TokenizerError,
    check_encodable,
    make_addition_rows,
    pair_split,
    save_jsonl,
)
from sapo_megatron.data.datasets import DatasetKeys, load_dataset
from sapo_megatron.data.tokenizer import HFTokenizer, load_tokenizer
from sapo_megatron.errors import UserError
from sapo_megatron.rewards import numeric_match

ROWS = [
    PromptRow(prompt=f"{i}+1=", ground_truth=str(i + 1), domain="addition" if i % 2 else None)
    for i in range(10)
]


def read(path):
    return load_dataset(path, DatasetKeys())


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_round_trip_and_blank_lines(tmp_path):
    path = save_jsonl(ROWS, tmp_path / "p.jsonl")
    path.write_text(path.read_text() + "\n\n")
    assert read(path) == ROWS


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "prompt": [r.prompt for r in ROWS],
            "ground_truth": [r.ground_truth for r in ROWS],
            "domain": [r.domain for r in ROWS],
            "extra": list(range(10)),
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    assert read(tmp_path / "p.parquet") == ROWS


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "1+1=", "ground_truth": ', "invalid JSON"),
        ('{"prompt": "1+1="}', "missing field 'ground_truth'"),
        (
            '{"prompt": 3, "ground_truth": "4"}',
            "field 'prompt' (the prompt) must be a string or a non-empty list",
        ),
        (
            '{"prompt": "1+1=", "ground_truth": "2", "domain": 5}',
            "field 'domain' (the source) must be a string or null",
        ),
        ('["1+1=", "2"]', "expected a JSON object, got list"),
    ],
)
def test_bad_jsonl_row_names_file_and_line(tmp_path, line, problem):
    good = json.dumps({"prompt": "1+1=", "ground_truth": "2"})
    path = write_lines(tmp_path / "bad.jsonl", [good, "", good, line])
    with pytest.raises(DatasetError) as err:
        read(path)
    assert str(err.value).startswith(f"{path}:4: ") and problem in str(err.value)


def test_bad_parquet_row_names_file_and_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table({"prompt": ["a", "b", None], "ground_truth": ["1", "2", "3"]}), tmp_path / "bad.parquet"
    )
    with pytest.raises(
        DatasetError,
        match=r"bad\.parquet row 2: field 'prompt' \(the prompt\) must be a string .* got NoneType",
    ):
        read(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"question": ["a"], "ground_truth": ["1"]}), tmp_path / "cols.parquet")
    with pytest.raises(DatasetError, match="cannot tell the file's format"):
        read(tmp_path / "cols.parquet")


def test_other_file_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        read(tmp_path / "missing.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(
        b'{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "caf\xe9"}\n'
    )
    with pytest.raises(DatasetError, match=r"latin1\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        read(tmp_path / "latin1.jsonl")
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown prompt file type"):
        read(tmp_path / "p.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match=r"no rows \(the file is empty"):
        read(tmp_path / "empty.jsonl")


def test_iterator_shuffles_per_epoch_deterministically():
    it = PromptIterator(ROWS, batch_size=4, seed=3, num_epochs=2)
    batches = list(it)
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4]  # 20 rows over two epochs, batches cross the boundary
    flat = [r for b in batches for r in b]
    assert sorted(flat[:10], key=ROWS.index) == ROWS and sorted(flat[10:], key=ROWS.index) == ROWS
    assert flat[:10] != flat[10:] and flat[:10] != ROWS  # each epoch its own order
    assert list(PromptIterator(ROWS, batch_size=4, seed=3, num_epochs=2)) == batches
    assert list(PromptIterator(ROWS, batch_size=4, seed=4, num_epochs=2)) != batches
    assert [r for b in PromptIterator(ROWS, batch_size=3, shuffle=False, num_epochs=1) for r in b] == ROWS


def test_iterator_resumes_exactly():
    reference = PromptIterator(ROWS, batch_size=3, seed=11)
    expected = [next(reference) for _ in range(9)]
    first = PromptIterator(ROWS, batch_size=3, seed=11)
    seen = [next(first) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptIterator(ROWS, batch_size=3, seed=11)
    resumed.load_state_dict(state)
    assert seen + [next(resumed) for _ in range(5)] == expected
    with pytest.raises(
        DatasetError, match="cannot resume the prompt order: the checkpoint was saved with fingerprint="
    ):
        PromptIterator([*ROWS[:-1], PromptRow("x", "y")], batch_size=3, seed=11).load_state_dict(state)
    with pytest.raises(DatasetError, match="saved with seed=11, this run has 12") as err:
        PromptIterator(ROWS, batch_size=3, seed=12).load_state_dict(state)
    assert "data files and seed" in err.value.hint


def test_take_continues_the_epoch_without_skipping_rows():
    taker = PromptIterator(ROWS, batch_size=4, seed=3)
    batches = PromptIterator(ROWS, batch_size=4, seed=3)
    reference = [r for _ in range(5) for r in next(batches)]  # 20 rows: two epochs in order
    taken = [next(taker), taker.take(1), taker.take(3), taker.take(0), next(taker), taker.take(8)]
    assert [len(part) for part in taken] == [4, 1, 3, 0, 4, 8]
    assert [r for part in taken for r in part] == reference
    assert (taker.state_dict()["epoch"], taker.state_dict()["position"]) == (1, 10)
    finite = PromptIterator(ROWS, batch_size=4, shuffle=False, num_epochs=1)
    assert finite.take(25) == ROWS and finite.take(1) == []  # a finite iterator stops after its last epoch


def test_state_after_take_resumes_exactly():
    first = PromptIterator(ROWS, batch_size=4, seed=5)
    next(first), first.take(3)  # a batch and a refill: position 7
    state = json.loads(json.dumps(first.state_dict()))
    expected = [next(first), first.take(5), next(first)]
    resumed = PromptIterator(ROWS, batch_size=4, seed=5)
    resumed.load_state_dict(state)
    assert [next(resumed), resumed.take(5), next(resumed)] == expected


def test_check_encodable_names_file_line_and_character(tmp_path):
    good = json.dumps({"prompt": "1+1=", "ground_truth": "2"})
    path = write_lines(
        tmp_path / "p.jsonl", [good, "", good, json.dumps({"prompt": "1+1=", "ground_truth": "Two"})]
    )
    rows = read(path)
    with pytest.raises(TokenizerError) as err:
        check_encodable(rows, CharTokenizer(), str(path))
    assert str(err.value) == (
        f"{path}:4: ground_truth 'Two' has the character 'T' (position 0), which the char tokenizer cannot encode"
    )
    assert isinstance(err.value, UserError) and "data.tokenizer" in err.value.hint
    check_encodable(rows[:2], CharTokenizer(), str(path))  # the first two rows are fine
    bad_prompt = [PromptRow("2+2=", "4"), PromptRow("2*2 = X", "4")]
    with pytest.raises(
        TokenizerError,
        match=r"^synthetic:addition row 1: prompt '2\*2 = X' has the character 'X' \(position 6\)",
    ):
        check_encodable(bad_prompt, CharTokenizer(), "synthetic:addition")
    with pytest.raises(
        TokenizerError, match=r"^train row 0: prompt 'Q: 2\+2=' has the character 'Q' \(position 0\)"
    ):
        check_encodable(
            bad_prompt, CharTokenizer(), "train", template="Q: {prompt}"
        )  # as the trainer formats it


def test_char_tokenizer_round_trip(tmp_path):
    tok = CharTokenizer()
    text = "12+34=46 #### what?"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == f"<bos>{text}<eos>"
    assert {tok.pad_id, tok.bos_id, tok.eos_id} == {0, 1, 2} and max(ids) < tok.vocab_size
    tok.save(tmp_path)
    loaded = CharTokenizer.load(tmp_path)
    assert loaded == tok and loaded.encode(text) == tok.encode(text) and loaded.vocab_size == tok.vocab_size
    with pytest.raises(TokenizerError, match=r"cannot encode '!' \(position 2 of '12!'\)"):
        tok.encode("12!")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])


def test_addition_task_is_deterministic_and_splits_never_overlap():
    train = make_addition_rows(300, digits=2, split="train", seed=5, heldout_fraction=0.2)
    assert train == make_addition_rows(300, digits=2, split="train", seed=5, heldout_fraction=0.2)
    assert train != make_addition_rows(300, digits=2, split="train", seed=6, heldout_fraction=0.2)
    heldout = make_addition_rows(100, digits=(1, 3), split="heldout", seed=5, heldout_fraction=0.2)

    def pair(row):
        a, b = row.prompt[:-1].split("+")
        return frozenset((int(a), int(b)))

    assert not {pair(r) for r in train} & {pair(r) for r in heldout}  # not even as b+a
    assert len({r.prompt for r in train}) == 300
    for row in train[:20]:
        a, b = (int(x) for x in row.prompt[:-1].split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row.ground_truth == str(a + b) and row.domain == "addition"
        assert pair_split(a, b, 0.2) == pair_split(b, a, 0.2) == "train"
        assert numeric_match(row.ground_truth, row.ground_truth) == 1.0
        CharTokenizer().encode(row.prompt + row.ground_truth)  # the demo tokenizer covers the task
    with pytest.raises(
        DatasetError, match=r"distinct heldout addition problems .*\(the eval dataset's size\)"
    ):
        make_addition_rows(50, digits=1, split="heldout", seed=0)


ADDITIONS = [f"{a}+{b}=" for a in range(10, 100) for b in range(10, 100)]


@pytest.fixture(scope="module")
def exported_char_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    CharTokenizer().save(directory)
    return directory


def test_exported_char_tokenizer_loads_with_transformers(exported_char_tokenizer):
    from transformers import AutoTokenizer

    tok = CharTokenizer()
    hf = AutoTokenizer.from_pretrained(exported_char_tokenizer)
    assert len(hf) == tok.vocab_size == 52
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    with_bos = hf(ADDITIONS)["input_ids"]  # transformers' default add_special_tokens=True prepends <bos>
    assert with_bos == [tok.encode(text, add_bos=True) for text in ADDITIONS]
    plain = hf(ADDITIONS, add_special_tokens=False)["input_ids"]
    assert plain == [tok.encode(text) for text in ADDITIONS]
    every_char = tok.chars + " 12 , 3. ab"
    assert hf(every_char, add_special_tokens=False)["input_ids"] == tok.encode(every_char)
    ids = tok.encode(every_char, add_bos=True, add_eos=True)
    assert hf.decode(ids, skip_special_tokens=True) == every_char  # spaces kept, specials skipped
    assert hf.decode(ids) == f"<bos>{every_char}<eos>"
    padded = hf(["1+1=", "22+33="], padding=True)
    assert padded["input_ids"][0] == [0, 0, *tok.encode("1+1=", add_bos=True)]  # left padding for generate
    with pytest.raises(Exception, match="UNK"):  # no unknown token: refused, never silently dropped
        hf("12!")


def test_char_tokenizer_still_loads_from_an_export(exported_char_tokenizer):
    assert load_tokenizer(str(exported_char_tokenizer)) == CharTokenizer()  # char_tokenizer.json wins


def test_hf_tokenizer_adapter_and_copy(exported_char_tokenizer, tmp_path):
    adapter = HFTokenizer(exported_char_tokenizer)
    tok = CharTokenizer()
    assert adapter.encode("12+34=", add_bos=True, add_eos=True) == tok.encode(
        "12+34=", add_bos=True, add_eos=True
    )
    assert adapter.vocab_size == tok.vocab_size and adapter.decode(tok.encode("7 + 8")) == "7 + 8"
    adapter.save(tmp_path / "copy")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "copy" / name).read_bytes() == (exported_char_tokenizer / name).read_bytes()


def test_tokenizer_loading_errors(tmp_path):
    with pytest.raises(TokenizerError, match=r"holds no tokenizer: none of tokenizer\.json"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(
        TokenizerError, match=r"tokenizer\.json: not valid JSON \(.* at line 1 column 2\)"
    ) as err:
        HFTokenizer(tmp_path)
    assert "\n" not in str(err.value)
    with pytest.raises(TokenizerError, match="not 'char', not 'chat', not 'qwen3' and not a directory"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "char_tokenizer.json").write_text('{"type": "bpe"}')
    with pytest.raises(TokenizerError, match="is not a char tokenizer file"):
        load_tokenizer(str(tmp_path))


def test_prompt_iterator_draws_each_row_once_across_threads():
    """The fully-async producer's chunks in flight draw prompts and refills at once: every ``take`` is atomic, so
    4 threads drawing 1-3 rows at a time through 3 epochs get every row of every epoch exactly once, and the state
    afterwards is where a single thread would be."""
    import sys
    import threading

    from sapo_megatron.data.prompts import PromptIterator, PromptRow

    rows = [PromptRow(prompt=f"p{i}", ground_truth=str(i)) for i in range(97)]
    it = PromptIterator(rows, batch_size=4, seed=3, num_epochs=3)
    drawn: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def draw(worker: int) -> None:
        start.wait(timeout=30)
        while batch := it.take(1 + worker % 3):
            drawn[worker].extend(int(row.ground_truth) for row in batch)

    threads = [threading.Thread(target=draw, args=(w,)) for w in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: without the lock this fails nearly every time
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    every = sorted(i for worker in drawn for i in worker)
    assert every == sorted(list(range(97)) * 3)
    assert it.state_dict()["epoch"] == 3 and it.state_dict()["position"] == 0
