"""Datasets with images: verl's geo3k parquet ({bytes, path} objects), slime's multimodal keys, jsonl with paths
and data URIs, several images per prompt; qwen_vl_utils' resize rule; every bad image named by file, row and
field before training; paths that leave the dataset's folder refused."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from sapo_megatron.data.datasets import DatasetKeys, read_dataset
from sapo_megatron.data.images import ImagePolicy, smart_resize
from sapo_megatron.data.prompts import DatasetError, PromptIterator

pytest.importorskip("pyarrow")
POLICY = ImagePolicy(factor=16, min_pixels=16 * 16, max_pixels=64 * 64)


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def geo3k_records(n: int) -> list[dict]:
    """Rows as verl's geo3k preprocessing writes them (examples/data_preprocess/geo3k.py): a chat prompt whose
    text holds <image>, an images column of {bytes, path}, reward_model.ground_truth, data_source."""
    return [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": f"<image>Find x in figure {i}."}],
            "images": [{"bytes": png(40 + i, 30), "path": None}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((30, 40), (32, 32)),  # sides rounded to multiples of 16 by Python's round: 40 / 16 = 2.5 -> 2
        ((30, 41), (32, 48)),
        ((8, 8), (16, 16)),  # at least one factor per side, area up to min_pixels
        ((200, 100), (80, 32)),  # area over 64*64: scaled by 1/sqrt(20000/4096) (90.5, 45.3), floored to 16
        ((5, 1500), None),  # aspect ratio 300 > 200
    ],
)
def test_smart_resize_is_qwen_vl_utils_rule(size, expected):
    if expected is None:
        with pytest.raises(ValueError, match="aspect ratio 300 is over 200"):
            smart_resize(*size, factor=16, min_pixels=256, max_pixels=4096)
        return
    assert smart_resize(*size, factor=16, min_pixels=256, max_pixels=4096) == expected


def test_verl_geo3k_parquet_reads_images_once(tmp_path):
    from PIL import Image

    path = write_parquet(tmp_path / "geo3k.parquet", geo3k_records(3))
    dataset = read_dataset(path, DatasetKeys(), POLICY)
    assert dataset.files[0].format == "verl"
    row = dataset.rows[1]
    assert row.ground_truth == "1" and row.domain == "hiyouga/geometry3k"
    assert [image.size for image in row.images] == [(32, 48)]  # 41x30 -> h 32, w 48
    assert row.images[0].where == f"{path} row 1 field images[0]"
    decoded = Image.open(io.BytesIO(row.images[0].png()))
    assert decoded.size == (48, 32) and decoded.getpixel((5, 5)) == (200, 30, 30)
    assert "3 images decoded and checked" in dataset.describe()[-1]


def test_jsonl_paths_data_uris_and_several_images(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(64, 64))
    uri = "data:image/png;base64," + base64.b64encode(png(20, 20, (0, 0, 255))).decode()
    record = {
        "prompt": "Compare <image> and <image>.",
        "ground_truth": "same",
        "images": ["img/a.png", uri],
    }
    path = write_jsonl(tmp_path / "data.jsonl", [record])
    row = read_dataset(path, DatasetKeys(), POLICY).rows[0]
    assert [image.size for image in row.images] == [(64, 64), (16, 16)]
    assert row.images[0].name() == str((tmp_path / "img" / "a.png").resolve())
    assert row.images[1].name().startswith("bytes:")
    # the fingerprint of the prompt order covers the images: other pixels, another order
    other = dict(record, images=[uri, "img/a.png"])
    row2 = read_dataset(write_jsonl(tmp_path / "b.jsonl", [other]), DatasetKeys(), POLICY).rows[0]
    fp = PromptIterator([row], batch_size=1)._fingerprint
    assert fp != PromptIterator([row2], batch_size=1)._fingerprint


def test_slime_multimodal_keys(tmp_path):
    record = {"input": "<image> What colour?", "label": "red", "pics": [uri(png(16, 16))]}
    path = write_jsonl(tmp_path / "slime.jsonl", [record])
    keys = DatasetKeys(format="slime", multimodal_keys={"image": "pics"})
    assert len(read_dataset(path, keys, POLICY).rows[0].images) == 1
    with pytest.raises(ValueError, match="only 'image' is supported"):
        DatasetKeys(multimodal_keys={"video": "clips"})


def test_bad_images_are_named_by_file_row_and_field(tmp_path):
    good = {"prompt": "<image> ?", "ground_truth": "1", "images": [uri(png(16, 16))]}
    cases = {
        "corrupt": (uri(png(16, 16)[:60]), "corrupt image|not an image"),
        "missing": ("nowhere.png", "image file .*nowhere.png does not exist"),
        "oversized": (uri(png(400, 300)), "400x300 pixels, over data.image_max_source_pixels"),
        "outside": ("../secret.png", "outside the dataset's folder"),
        "url": ("https://example.com/a.png", "image URLs are not fetched"),
        "not base64": ("data:image/png;base64,***", "not valid base64"),
    }
    (tmp_path.parent / "secret.png").write_bytes(png(16, 16))
    policy = ImagePolicy(factor=16, min_pixels=256, max_pixels=4096, max_source_pixels=100_000)
    for name, (value, message) in cases.items():
        bad = dict(good, images=[uri(png(16, 16)), value], prompt="<image><image>?")
        path = write_jsonl(tmp_path / f"{name.replace(' ', '_')}.jsonl", [good, bad])
        with pytest.raises(DatasetError, match=message) as info:
            read_dataset(path, DatasetKeys(), policy)
        assert str(info.value).startswith(f"{path}:2 field images[1]: "), name


def test_outside_path_allowed_when_asked_and_counts_checked(tmp_path):
    (tmp_path / "shared.png").write_bytes(png(16, 16))
    (tmp_path / "data").mkdir()
    record = {"prompt": "<image>?", "ground_truth": "1", "images": str(tmp_path / "shared.png")}
    path = write_jsonl(tmp_path / "data" / "d.jsonl", [record])
    keys = DatasetKeys(allow_image_paths_outside=True)
    assert read_dataset(path, keys, keys.image_policy(16, 256, 4096)).rows[0].images[0].size == (16, 16)
    write_jsonl(path, [dict(record, prompt="no placeholder")])
    with pytest.raises(
        DatasetError, match=r"d.jsonl:1: the prompt has 0 <image> placeholders but field 'images'"
    ):
        read_dataset(path, keys, POLICY)
    write_jsonl(path, [record])
    with pytest.raises(DatasetError, match="this model has no image processor"):
        read_dataset(path, keys)


def test_policy_bounds_follow_the_processor():
    keys = DatasetKeys(image_max_pixels=4096)
    policy = keys.image_policy(32, 1024, 8192)
    assert (policy.min_pixels, policy.max_pixels, policy.factor) == (1024, 4096, 32)
    with pytest.raises(DatasetError, match="must lie within the image processor's"):
        DatasetKeys(image_max_pixels=10_000).image_policy(32, 1024, 8192)
