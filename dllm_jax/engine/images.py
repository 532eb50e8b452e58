"""Images in a prompt (DiffusionGemma): what a request may send, checked and preprocessed on the host.

An image arrives as SGLang's ``image_data`` item: raw bytes of an image file, a local path, base64 text or a
``data:image/...;base64,`` URL (or a PIL image, from Python). An ``http(s)`` URL is refused by name: the server
fetches nothing. Bad input is a ``ValueError`` naming the field (``image_data[1]: not an image ...``): not an
image, too large (bytes or pixels), too many per request.

The prompt holds one image token per image (what the chat template writes for an image part, Gemma 4's
``<|image|>``); each is expanded to ``begin-of-image, image x n, end-of-image`` with ``n`` the image's soft tokens
(the processor's count), as transformers' ``Gemma4Processor`` does. Preprocessing is transformers' own Gemma 4
image processor (resize keeping the aspect ratio to the patch budget, rescale to ``[0, 1]``, patchify, pad to the
budget): every image has the same array shapes, so the tower compiles once per batch bucket.

Prefix reuse keys (:func:`cache_keys`): the prompt's ids with each image token replaced by the digest of its
image's preprocessed pixels, so the same image (whatever its file encoding) reuses cached pages and a different
image never matches another's.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import json
import os

import numpy as np

MAX_IMAGES_PER_REQUEST = 16
MAX_IMAGE_BYTES = 32 * 1024 * 1024  # an encoded image file
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decoded width x height


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedImage:
    """One image as the tower reads it: ``pixel_values [P, 3 * patch**2]`` float32, ``positions [P, 2]`` int32
    (padding ``-1``), the soft tokens it becomes, and the digest that keys its pages in the prefix cache."""

    pixel_values: np.ndarray
    positions: np.ndarray
    num_soft_tokens: int
    digest: bytes


def _decode(item, field: str, allow_paths: bool = True):
    """A PIL image from one ``image_data`` item (bytes / path / base64 / data URL / PIL image; a path only with
    ``allow_paths``: from Python, never from a server's client)."""
    from PIL import Image

    if isinstance(item, Image.Image):
        return item
    if isinstance(item, str):
        text = item.strip()
        low = text[:16].lower()
        if low.startswith(("http://", "https://")):
            raise ValueError(f"{field}: http(s) URLs are not fetched (the server fetches nothing); send the image "
                             f"as a data URL or base64")
        if low.startswith("data:"):
            head, _, payload = text.partition(",")
            if not head.lower().startswith("data:image/") or ";base64" not in head.lower():
                raise ValueError(f"{field}: a data URL must be 'data:image/<type>;base64,<data>'")
            data = _b64(payload, field, "")
        elif allow_paths and len(text) < 4096 and os.path.isfile(text):
            if os.path.getsize(text) > MAX_IMAGE_BYTES:
                raise ValueError(f"{field}: the image file is larger than {MAX_IMAGE_BYTES} bytes")
            with open(text, "rb") as f:
                data = f.read()
        else:
            data = _b64(text, field, "a file path, " if allow_paths else "")
    elif isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
    else:
        raise ValueError(f"{field}: must be image bytes, a path, base64 text or a data URL, got "
                         f"{type(item).__name__}")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{field}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"{field}: the image has {image.width} x {image.height} pixels, more than "
                             f"{MAX_IMAGE_PIXELS}")
        image.load()
    except ValueError:
        raise
    except Exception as e:  # PIL: UnidentifiedImageError, truncated files, decompression bombs
        raise ValueError(f"{field}: not an image ({type(e).__name__}: {e})") from None
    return image


def _b64(text: str, field: str, path: str = "") -> bytes:
    if len(text) > 4 * MAX_IMAGE_BYTES // 3 + 4:
        raise ValueError(f"{field}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: not an image (not {path}base64 or a data URL)") from None


def _processor_settings(model_dir: str, vcfg) -> dict:
    """The image processor's settings: the checkpoint's ``preprocessor_config.json`` (or the ``image_processor``
    section of ``processor_config.json``), else the vision config's patch and pooling with transformers' budget."""
    settings = {}
    for name, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                data = json.load(f)
            data = data.get(section, {}) if section else data
            settings = {k: data[k] for k in ("patch_size", "max_soft_tokens", "pooling_kernel_size") if k in data}
            if settings:
                break
    settings.setdefault("patch_size", vcfg.patch_size)
    settings.setdefault("pooling_kernel_size", vcfg.pooling_kernel_size)
    return settings


class ImageInputs:
    """The engine's images part: preprocess (transformers' Gemma 4 image processor), expand the prompt."""

    def __init__(self, model_dir: str, vcfg):
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        self.vcfg = vcfg
        self.processor = Gemma4ImageProcessorPil(**_processor_settings(model_dir, vcfg))
        self.max_patches = self.processor.max_soft_tokens * self.processor.pooling_kernel_size ** 2
        self.soft_tokens = self.max_patches // vcfg.pooling_kernel_size ** 2  # the tower's output rows per image

    def prepare(self, items, field: str = "image_data", *, allow_paths: bool = True) -> list[PreparedImage]:
        """The images of one prompt (one item or a list; prepared ones pass through)."""
        listed = isinstance(items, (list, tuple))
        items = list(items) if listed else [items]
        if len(items) > MAX_IMAGES_PER_REQUEST:
            raise ValueError(f"{field}: {len(items)} images, at most {MAX_IMAGES_PER_REQUEST} per request")
        out = []
        for i, item in enumerate(items):
            where = f"{field}[{i}]" if listed else field
            if isinstance(item, PreparedImage):
                out.append(item)
                continue
            image = _decode(item, where, allow_paths)
            try:
                batch = self.processor(images=[image.convert("RGB")], return_tensors="np")
            except ValueError as e:  # an image too thin to resize into the patch grid
                raise ValueError(f"{where}: {e}") from None
            pixels = np.ascontiguousarray(batch["pixel_values"][0], np.float32)
            positions = np.ascontiguousarray(batch["image_position_ids"][0], np.int32)
            digest = hashlib.sha256(pixels.tobytes() + positions.tobytes()).digest()
            out.append(PreparedImage(pixels, positions, int(batch["num_soft_tokens_per_image"][0]), digest))
        return out

    def expand(self, ids: list[int], images: list[PreparedImage], field: str = "image_data"):
        """The prompt with each image token expanded, and its image spans ``(first position, count, image)``."""
        v = self.vcfg
        placeholders = [i for i, t in enumerate(ids) if t == v.image_token_id]
        if len(placeholders) != len(images):
            raise ValueError(f"{field}: {len(images)} image(s) but the prompt has {len(placeholders)} image "
                             f"token(s) (id {v.image_token_id}: one per image, where the image goes)")
        out, spans, last = [], [], 0
        for k, (at, image) in enumerate(zip(placeholders, images)):
            out += ids[last:at] + [v.boi_token_id]
            spans.append((len(out), image.num_soft_tokens, k))
            out += [v.image_token_id] * image.num_soft_tokens + [v.eoi_token_id]
            last = at + 1
        return out + ids[last:], tuple(spans)


def cache_keys(ids: list[int], images, spans) -> list:
    """The prefix cache's keys of a prompt: its ids, each image token replaced by its image's digest."""
    keys = list(ids)
    for start, count, k in spans:
        keys[start:start + count] = [images[k].digest] * count
    return keys
