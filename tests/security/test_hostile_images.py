"""Hostile image datasets (issue 39, area "images"): a FIFO, a NUL byte, an empty path and a non-http URL are
refused in one line (CLEAR); 16-bit grey and transparency are converted as qwen_vl_utils' rule says (OK); a file
rewritten after the check is refused when it is read for training (CLEAR); a text-only row that spells the image
pad is refused (CLEAR). On 3855bb6: a hang, a traceback, white / black images, the rewritten file used, and
silence."""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading

import pytest

from sapo_megatron.data.images import ImagePolicy, check_image
from tests.security.hostile import case, expect

pytest.importorskip("PIL")
AREA = "images"
POLICY = ImagePolicy(factor=16, min_pixels=256, max_pixels=1 << 20)


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def within(seconds: float, action):
    """``action()`` in a thread: a hang fails the test instead of stopping it."""
    box: dict = {}

    def run():
        try:
            box["value"] = action()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (a hang)"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("cls", [case(AREA, "image path is a FIFO", "CLEAR")])
def test_a_fifo_is_refused_without_opening_it(tmp_path, cls):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    try:
        expect(
            cls, lambda: within(5, lambda: check_image("pipe.png", "d.jsonl:1", tmp_path, POLICY)), "a FIFO"
        )
    finally:  # release a reader blocked on the FIFO (the old code's hang)
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize(
    ("cls", "value", "words"),
    [
        case(AREA, "NUL byte in an image path", "CLEAR", "a\x00b.png", "NUL byte"),
        case(AREA, "empty image path", "CLEAR", "", "the image path is empty"),
        case(AREA, "s3:// image URL", "CLEAR", "s3://bucket/cat.png", "image URLs are not fetched"),
        pytest.param("CLEAR", "gs://bucket/cat.png", "image URLs are not fetched", id="gs"),
        pytest.param("CLEAR", "   ", "the image path is empty", id="blank"),
    ],
)
def test_bad_image_paths_are_one_line(tmp_path, cls, value, words):
    expect(cls, lambda: check_image(value, "d.jsonl:1 field images[0]", tmp_path, POLICY), "d.jsonl:1", words)


def checked(tmp_path, image, name="im.png"):
    (tmp_path / name).write_bytes(png_bytes(image))
    return check_image(name, "d.jsonl:1", tmp_path, POLICY)


@pytest.mark.parametrize("cls", [case(AREA, "16-bit PNG", "OK")])
def test_16_bit_grey_is_scaled_not_clipped_to_white(tmp_path, cls):
    from PIL import Image

    image = Image.new("I;16", (32, 32), 30000)  # 30000 / 65535 of full scale: 117 in 8 bits
    ref = expect(cls, lambda: checked(tmp_path, image))
    assert Image.open(tmp_path / "im.png").mode.startswith("I")  # the file really is 16-bit
    assert ref.load().getpixel((5, 5)) == (117, 117, 117)


@pytest.mark.parametrize("cls", [case(AREA, "transparent RGBA background", "OK")])
def test_transparency_is_pasted_on_white_as_qwen_vl_utils_does(tmp_path, cls):
    from PIL import Image

    image = Image.new("RGBA", (32, 32), (0, 0, 0, 0))  # transparent black background
    image.putpixel((1, 1), (0, 0, 0, 255))  # one opaque black pixel
    for x in range(16, 32):
        for y in range(32):
            image.putpixel((x, y), (0, 0, 0, 128))  # half-transparent black
    loaded = expect(cls, lambda: checked(tmp_path, image)).load()
    # qwen_vl_utils' to_rgb: Image.new("RGB", size, white).paste(image, mask=alpha)
    rule = Image.new("RGB", image.size, (255, 255, 255))
    rule.paste(image, mask=image.split()[3])
    assert loaded.getpixel((8, 8)) == (255, 255, 255) and loaded.getpixel((1, 1)) == (0, 0, 0)
    assert list(loaded.getdata()) == list(rule.getdata())
    la = checked(tmp_path, image.convert("LA"), "la.png").load()
    assert la.getpixel((8, 8)) == (255, 255, 255)


@pytest.mark.parametrize("cls", [case(AREA, "image rewritten after the check", "CLEAR")])
def test_an_image_rewritten_after_the_check_is_refused(tmp_path, cls):
    from PIL import Image

    ref = checked(tmp_path, Image.new("RGB", (32, 32), (10, 20, 30)))
    assert ref.load().getpixel((0, 0)) == (10, 20, 30)
    (tmp_path / "im.png").write_bytes(png_bytes(Image.new("RGB", (32, 32), (200, 0, 0))))
    expect(cls, ref.load, "changed after the dataset was checked", str(tmp_path / "im.png"))


@pytest.mark.parametrize("cls", [case(AREA, "image pad text in a text-only row", "CLEAR")])
def test_a_text_row_spelling_the_image_pad_is_refused(tmp_path, cls):
    from sapo_megatron.data.datasets import DatasetKeys, read_dataset
    from sapo_megatron.data.render import PromptRenderer
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.data.vision import load_image_processor, vision_spec
    from tests.vl_fixtures import make_vl_tokenizer

    vl_dir = make_vl_tokenizer(tmp_path / "vl")
    tok = load_tokenizer(str(vl_dir))
    spec = vision_spec(tok, load_image_processor(vl_dir), str(vl_dir))
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "What is <|image_pad|> here?", "ground_truth": "x"}) + "\n")
    keys = DatasetKeys(apply_chat_template=True)
    rows = read_dataset(path, keys, keys.image_policy(spec.factor, spec.min_pixels, spec.max_pixels)).rows
    renderer = PromptRenderer(tok, keys, spec)
    expect(cls, lambda: renderer.encode(rows[0]), "without images holds the image-pad token")
