"""The images of a multimodal dataset: each read, checked and sized once, when the dataset is loaded.

A row's image is an ``{bytes, path}`` object (verl's parquet, the HF ``datasets`` Image feature: the bytes win
when both are set), a string (a ``data:image/...;base64,`` URI, or a file path, ``file://`` allowed), or a list
of those (several images per prompt). A relative path is relative to the dataset file's folder; a path that
resolves outside that folder (``..``, an absolute path, a symlink) is refused unless
``data.allow_image_paths_outside`` is set, so that a dataset cannot make the trainer read arbitrary files.
URLs (any ``scheme://`` but ``file://``: ``http``, ``s3``, ``gs``...) are refused: a run never downloads. A path
must name a regular file (a FIFO, a device or a folder is refused before it is opened) and hold no NUL byte.

:func:`check_image` opens every image (the header first: its size is refused above
``data.image_max_source_pixels`` before any pixel is decoded), decodes it fully (a truncated or corrupt file is
named), and computes its resized size with qwen_vl_utils' rule (:func:`smart_resize`). :class:`ImageRef` keeps
where the image is and that size; :meth:`ImageRef.png` gives the resized image as PNG bytes, what the trainer's
image processor and every rollout engine (SGLang's ``image_data``) then receive, so that both see one grid.

Colour (:func:`to_rgb`): an image with transparency (RGBA, LA, a palette with a transparent colour) is pasted on
white, as qwen_vl_utils' ``to_rgb`` does; a 16-bit grey image is scaled to 8 bits (its top byte) before the RGB
conversion – PIL's plain ``convert("RGB")``, which qwen_vl_utils applies to every other mode, clips 16-bit values
at 255, so such an image would train as white. A file image is read again for training and its sha256 compared
with the one taken when the dataset was checked: a file rewritten in between is refused, never used unchecked.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import math
import os
import re
import stat
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
        """The resized RGB image (PIL); a file image must still be the one that was checked."""
        from PIL import Image

        if self.data is not None:
            raw = self.data
        elif self.path is not None:
            raw = self._read_again(self.path)
        else:
            raise ValueError(f"{self.where}: the image holds neither bytes nor a path")
        with Image.open(io.BytesIO(raw)) as image:
            rgb = to_rgb(image)
        height, width = self.size
        if rgb.size == (width, height):
            return rgb
        # qwen_vl_utils' fetch_image: image.resize((w, h)), PIL's default (bicubic) filter for RGB
        return rgb.resize((width, height), Image.Resampling.BICUBIC)

    def _read_again(self, path: str) -> bytes:
        try:
            raw = _regular_file(Path(path), self.where).read_bytes()
        except OSError as exc:
            raise DatasetError(
                f"{self.where}: cannot read image file {self.path} again: {exc.strerror}"
            ) from None
        if hashlib.sha256(raw).hexdigest()[:12] != self.digest:
            raise DatasetError(
                f"{self.where}: image file {self.path} changed after the dataset was checked (sha256 "
                f"{hashlib.sha256(raw).hexdigest()[:12]}, checked {self.digest})",
                hint="do not rewrite a dataset's images while a run uses them; restart the run to check them again",
            )
        return raw

    def png(self) -> bytes:
        """The resized image as PNG (lossless: every reader decodes the same pixels)."""
        out = io.BytesIO()
        self.load().save(out, format="PNG")
        return out.getvalue()


def to_rgb(image: Any) -> Any:
    """``image`` as 8-bit RGB (PIL): transparency pasted on white (qwen_vl_utils' ``to_rgb``), 16-bit grey scaled
    to its top byte, anything else by PIL's ``convert("RGB")``."""
    from PIL import Image

    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        import numpy as np

        values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8
        return Image.fromarray(values.astype(np.uint8)).convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    return image.convert("RGB")


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
    if isinstance(value, str) and not value.strip():
        raise DatasetError(
            f"{where}: the image path is empty", hint="give a file path, a data URI or image bytes"
        )
    if isinstance(value, str):
        if value.startswith("data:"):
            return _data_uri(value, where, policy)
        scheme = _URL.match(value)
        if scheme and scheme.group(1).lower() != "file":
            raise DatasetError(
                f"{where}: image URLs are not fetched ({value[:60]}): a run never downloads",
                hint="download the images next to the dataset and write their paths",
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


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _path(text: str, where: str, folder: Path, policy: ImagePolicy) -> Path:
    if "\0" in text:
        raise DatasetError(
            f"{where}: the image path {text[:60]!r} holds a NUL byte; no file can have that name"
        )
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


def _regular_file(path: Path, where: str) -> Path:
    """``path`` when it names a regular file (a FIFO would block its reader for ever)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        raise DatasetError(f"{where}: image file {path} does not exist") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise DatasetError(f"{where}: image path {path} is {kind}; an image must be a regular file")
    return path


def _read(path: Path, where: str, policy: ImagePolicy) -> bytes:
    _check_bytes(_regular_file(path, where).stat().st_size, where, policy)
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
