"""The images of a multimodal dataset: each read, checked and sized once, when the dataset is loaded.

A row's image is an ``{bytes, path}`` object (verl's parquet, the HF ``datasets`` Image feature: the bytes win
when both are set), a string (a ``data:image/...;base64,`` URI, or a file path, ``file://`` allowed), or a list
of those (several images per prompt). A relative path is relative to the dataset file's folder; a path that
resolves outside that folder (``..``, an absolute path, a symlink) is refused unless
``data.allow_image_paths_outside`` is set, so that a dataset cannot make the trainer read arbitrary files.
URLs are refused: a run never downloads.

:func:`check_image` opens every image (the header first: its size is refused above
``data.image_max_source_pixels`` before any pixel is decoded), decodes it fully (a truncated or corrupt file is
named), and computes its resized size with qwen_vl_utils' rule (:func:`smart_resize`). :class:`ImageRef` keeps
where the image is and that size; :meth:`ImageRef.png` gives the resized image as PNG bytes, what the trainer's
image processor and every rollout engine (SGLang's ``image_data``) then receive, so that both see one grid.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import math
import os
from pathlib import Path
from typing import Any

from sapo_megatron.data.prompts import DatasetError

MAX_RATIO = 200
"""qwen_vl_utils refuses images whose long side is over 200 times the short side."""


@dataclasses.dataclass(frozen=True)
class ImagePolicy:
    """How a dataset's images are sized and where they may come from (``data.image_*``).

    ``factor`` is the image processor's patch size times its merge size (32 for Qwen3-VL), so that a resized
    image splits into whole merged patches."""

    factor: int
    min_pixels: int
    max_pixels: int
    max_source_pixels: int = 40_000_000
    max_file_bytes: int = 32 << 20
    allow_paths_outside: bool = False

    def __post_init__(self) -> None:
        if self.min_pixels > self.max_pixels:
            raise DatasetError(
                f"data.image_min_pixels={self.min_pixels} is above data.image_max_pixels={self.max_pixels}"
            )
        if self.max_pixels < self.factor * self.factor:
            raise DatasetError(
                f"data.image_max_pixels={self.max_pixels} is below one merged patch "
                f"({self.factor}x{self.factor} pixels): no image could be shown"
            )


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One checked image: ``where`` names it (``file row i field images[0]``), ``data`` or ``path`` holds it,
    ``size`` is its ``(height, width)`` after resizing, ``digest`` the sha256 of its encoded bytes (12 hex)."""

    where: str
    size: tuple[int, int]
    digest: str
    data: bytes | None = None
    path: str | None = None

    def name(self) -> str:
        """How ``samples.jsonl`` names it: the file path, else the digest of the bytes."""
        return self.path if self.path is not None else f"bytes:{self.digest}"

    def load(self) -> Any:
        """The resized RGB image (PIL)."""
        from PIL import Image

        if self.data is not None:
            raw = self.data
        elif self.path is not None:
            raw = Path(self.path).read_bytes()
        else:
            raise ValueError(f"{self.where}: the image holds neither bytes nor a path")
        with Image.open(io.BytesIO(raw)) as image:
            rgb = image.convert("RGB")
        height, width = self.size
        if rgb.size == (width, height):
            return rgb
        # qwen_vl_utils' fetch_image: image.resize((w, h)), PIL's default (bicubic) filter for RGB
        return rgb.resize((width, height), Image.Resampling.BICUBIC)

    def png(self) -> bytes:
        """The resized image as PNG (lossless: every reader decodes the same pixels)."""
        out = io.BytesIO()
        self.load().save(out, format="PNG")
        return out.getvalue()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """qwen_vl_utils' ``smart_resize`` (QwenLM/Qwen2-VL, qwen-vl-utils/src/qwen_vl_utils/vision_process.py):
    both sides rounded to multiples of ``factor``, the area brought into ``[min_pixels, max_pixels]`` keeping the
    aspect ratio. Raises ValueError for an aspect ratio over 200."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over {MAX_RATIO}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_values(value: Any) -> list[Any]:
    """A row's image field as a list (a single image, a list of them, or nothing)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def check_image(value: Any, where: str, folder: Path, policy: ImagePolicy) -> ImageRef:
    """Open, check and size one image of a row; ``where`` names the file, row and field in every error."""
    source = _source(value, where, folder, policy)
    raw = source if isinstance(source, bytes) else _read(source, where, policy)
    height, width = _decode(raw, where, policy)
    try:
        size = smart_resize(height, width, policy.factor, policy.min_pixels, policy.max_pixels)
    except ValueError as exc:
        raise DatasetError(f"{where}: image of {width}x{height} pixels: {exc}") from None
    digest = hashlib.sha256(raw).hexdigest()[:12]
    return ImageRef(
        where=where,
        size=size,
        digest=digest,
        data=source if isinstance(source, bytes) else None,
        path=None if isinstance(source, bytes) else str(source),
    )


def _source(value: Any, where: str, folder: Path, policy: ImagePolicy) -> bytes | Path:
    """An image value's bytes, or the path of its file."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            data = value["bytes"]
            if not isinstance(data, bytes | bytearray):
                raise DatasetError(f"{where}: 'bytes' must be binary, got {type(data).__name__}")
            _check_bytes(len(data), where, policy)
            return bytes(data)
        if isinstance(value.get("path"), str) and value["path"]:
            return _path(value["path"], where, folder, policy)
        raise DatasetError(f"{where}: an image object needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, bytes | bytearray):
        _check_bytes(len(value), where, policy)
        return bytes(value)
    if isinstance(value, str) and value:
        if value.startswith("data:"):
            return _data_uri(value, where, policy)
        if value.startswith(("http://", "https://")):
            raise DatasetError(
                f"{where}: image URLs are not fetched ({value[:60]}); store the image in the dataset's folder"
            )
        return _path(value.removeprefix("file://"), where, folder, policy)
    raise DatasetError(
        f"{where}: an image must be a path, a data URI or an object with 'bytes' / 'path', got "
        f"{type(value).__name__}"
    )


def _data_uri(value: str, where: str, policy: ImagePolicy) -> bytes:
    header, sep, payload = value.partition(",")
    if not sep or not header.endswith(";base64"):
        raise DatasetError(f"{where}: a data URI image must be 'data:image/...;base64,<data>'")
    _check_bytes(len(payload) * 3 // 4, where, policy)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DatasetError(f"{where}: the data URI is not valid base64 ({exc})") from None


def _path(text: str, where: str, folder: Path, policy: ImagePolicy) -> Path:
    path = Path(text)
    path = path if path.is_absolute() else folder / path
    resolved = Path(os.path.realpath(path))
    root = Path(os.path.realpath(folder))
    if not policy.allow_paths_outside and not resolved.is_relative_to(root):
        raise DatasetError(
            f"{where}: image path {text!r} is outside the dataset's folder {root}",
            hint="move the images next to the dataset, or set data.allow_image_paths_outside: true if this "
            "dataset is trusted",
        )
    return resolved


def _read(path: Path, where: str, policy: ImagePolicy) -> bytes:
    try:
        size = path.stat().st_size
    except OSError:
        raise DatasetError(f"{where}: image file {path} does not exist") from None
    _check_bytes(size, where, policy)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{where}: cannot read image file {path}: {exc.strerror}") from None


def _check_bytes(size: int, where: str, policy: ImagePolicy) -> None:
    if size > policy.max_file_bytes:
        raise DatasetError(
            f"{where}: the image is {size} bytes, over data.image_max_file_bytes={policy.max_file_bytes}"
        )


def _decode(raw: bytes, where: str, policy: ImagePolicy) -> tuple[int, int]:
    """``(height, width)`` of an encoded image, decoded in full; the size is checked from the header first."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise DatasetError(
            f"{where}: reading images needs Pillow: pip install 'sapo-megatron[vision]'"
        ) from None

    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            if width * height > policy.max_source_pixels:
                raise DatasetError(
                    f"{where}: the image is {width}x{height} pixels, over "
                    f"data.image_max_source_pixels={policy.max_source_pixels}"
                )
            image.load()  # decode every pixel: a truncated or corrupt file fails here, not in training
    except DatasetError:
        raise
    except UnidentifiedImageError:
        raise DatasetError(f"{where}: not an image PIL can read ({len(raw)} bytes)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"{where}: corrupt image: {exc}") from None
    if width < 1 or height < 1:
        raise DatasetError(f"{where}: the image has no pixels ({width}x{height})")
    return height, width
