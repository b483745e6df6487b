"""Visual tasks with verifiable answers, made here (no downloads): a seeded PIL generator and the easy-VQA set.

:func:`write_visual_dataset` draws images and writes a dataset folder the ordinary reader takes: ``{split}.jsonl``
(plain layout: ``prompt`` with ``<image>``, ``ground_truth``, ``domain`` = the task, ``images`` = a path inside
the folder) and ``images/*.png``. The tasks:

==============  ===================================================  ==================  =============
task            the image                                            the question        the answer
==============  ===================================================  ==================  =============
count_shapes    1-5 circles, 0-3 squares, not overlapping            how many circles?   a number
name_colour     one shape in one of 6 colours                        what colour is it?  a colour word
read_digits     a 1-3 digit number drawn in PIL's built-in font      what number?        a number
geometry        a rectangle labelled with its width and height       its area?           a number
==============  ===================================================  ==================  =============

Numbers score with ``numeric_match``, colour words with ``exact_match``; each task is its own source, so the
per-source metrics of training and evaluation report each. The same ``seed`` gives the same files.

:func:`write_easy_vqa_dataset` writes the easy-VQA questions (PyPI ``easy-vqa`` 1.0, MIT, its 64x64 PNGs inside
the wheel: 38,575 train / 9,673 test questions over 4,000 / 1,000 images, 13 one-word answers) in the same layout,
the images copied into the folder; the source is the question's kind (``shape``, ``colour``, ``yes/no``).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sapo_megatron.data.prompts import DatasetError

SIZE = 64
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 170),
    "orange": (240, 140, 30),
}
ANSWER_FORMAT = " Answer with one word or number in \\boxed{}."

Record = dict[str, Any]


def _count_shapes(rng: random.Random) -> tuple[Any, str, str]:
    image, draw = _canvas()
    circles, squares = rng.randint(1, 5), rng.randint(0, 3)
    boxes: list[tuple[int, int, int, int]] = []
    for kind in ["circle"] * circles + ["square"] * squares:
        box = _free_box(rng, boxes, 10)
        colour = COLOURS[rng.choice(list(COLOURS))]
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=colour)
    return image, "How many circles are in the image?", str(circles)


def _name_colour(rng: random.Random) -> tuple[Any, str, str]:
    image, draw = _canvas()
    name = rng.choice(list(COLOURS))
    shape = rng.choice(["circle", "square"])
    box = _free_box(rng, [], rng.randint(20, 40))
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[name])
    return image, f"What colour is the {shape}?", name


def _read_digits(rng: random.Random) -> tuple[Any, str, str]:
    image, draw = _canvas()
    number = rng.randint(0, 999)
    draw.text((rng.randint(2, 30), rng.randint(2, 48)), str(number), fill=(0, 0, 0))
    return image, "What number is written in the image?", str(number)


def _geometry(rng: random.Random) -> tuple[Any, str, str]:
    image, draw = _canvas()
    width, height = rng.randint(2, 9), rng.randint(2, 9)
    left, top = 14, 10
    right, bottom = left + width * 4, top + height * 4
    draw.rectangle((left, top, right, bottom), outline=(0, 0, 0), width=1)
    draw.text(((left + right) // 2 - 2, bottom + 2), str(width), fill=(0, 0, 0))
    draw.text((right + 3, (top + bottom) // 2 - 4), str(height), fill=(0, 0, 0))
    return image, "The rectangle's sides are labelled. What is its area?", str(width * height)


TASKS: dict[str, Callable[[random.Random], tuple[Any, str, str]]] = {
    "count_shapes": _count_shapes,
    "name_colour": _name_colour,
    "read_digits": _read_digits,
    "geometry": _geometry,
}


def write_visual_dataset(
    directory: str | Path, n: int, *, seed: int = 0, tasks: Sequence[str] = tuple(TASKS), split: str = "train"
) -> Path:
    """Draw ``n`` examples (the tasks in turn) into ``directory``; returns the ``{split}.jsonl`` written."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise DatasetError(f"unknown visual task {unknown[0]!r}; the tasks are {', '.join(TASKS)}")
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{seed}-{split}")
    records = []
    for index in range(n):
        task = tasks[index % len(tasks)]
        image, question, answer = TASKS[task](rng)
        name = f"images/{split}-{index:06d}.png"
        image.save(directory / name, format="PNG")
        records.append(_record(question, answer, task, name))
    return _write(directory / f"{split}.jsonl", records)


def write_easy_vqa_dataset(directory: str | Path, *, split: str = "train", limit: int | None = None) -> Path:
    """The easy-VQA questions of ``split`` (``train`` / ``test``; the first ``limit``) as a dataset folder."""
    try:
        import easy_vqa
    except ImportError as exc:
        raise DatasetError(
            "the easy-VQA loader needs its package: pip install 'sapo-megatron[vision]'"
        ) from exc
    if split not in ("train", "test"):
        raise DatasetError(f"easy-VQA has the splits train and test, not {split!r}")
    questions, answers, image_ids = getattr(easy_vqa, f"get_{split}_questions")()
    paths = getattr(easy_vqa, f"get_{split}_image_paths")()
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for question, answer, image_id in list(zip(questions, answers, image_ids))[:limit]:
        name = f"images/{split}-{image_id}.png"
        if not (directory / name).is_file():
            shutil.copyfile(paths[image_id], directory / name)
        records.append(_record(question[:1].upper() + question[1:], answer, _vqa_kind(answer), name))
    return _write(directory / f"{split}.jsonl", records)


def _vqa_kind(answer: str) -> str:
    if answer in ("yes", "no"):
        return "easy_vqa_yes_no"
    return "easy_vqa_shape" if answer in ("circle", "rectangle", "triangle") else "easy_vqa_colour"


def _record(question: str, answer: str, source: str, image: str) -> Record:
    return {
        "prompt": f"<image>{question}{ANSWER_FORMAT}",
        "ground_truth": answer,
        "domain": source,
        "images": [image],
    }


def _write(path: Path, records: list[Record]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _canvas() -> tuple[Any, Any]:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    return image, ImageDraw.Draw(image)


def _free_box(
    rng: random.Random, taken: list[tuple[int, int, int, int]], side: int
) -> tuple[int, int, int, int]:
    """A ``side``-pixel box inside the canvas overlapping none of ``taken`` (which it joins)."""
    for _ in range(1000):
        x, y = rng.randint(1, SIZE - side - 1), rng.randint(1, SIZE - side - 1)
        box = (x, y, x + side, y + side)
        if all(box[2] < b[0] or b[2] < box[0] or box[3] < b[1] or b[3] < box[1] for b in taken):
            taken.append(box)
            return box
    raise AssertionError("no free place for a shape: too many shapes for the canvas")
