"""Images in conversation records, for Step-3.7 runs (`data.images`): where a record names its images, how each
becomes its placeholder run in the rendered text, and the fixed-shape pixel tensors a window carries.

Where images come from (`record_images`), in the order they appear in the conversation:

* an image content part with its own source: `{"type": "image", "image": PATH}` (also `url` or `path` instead of
  `image`; transformers' and TRL's form), `{"type": "image_url", "image_url": {"url": URL}}` (OpenAI chat's) or
  `{"type": "input_image", "image_url": URL}` (OpenAI Responses');
* an image slot that takes the next entry of the record's `images` list (a column beside `messages`): an image
  part without a source (TRL's vision datasets), or an `<image>` marker in a message's text (LLaMA-Factory's form;
  read as a marker only in a record that has an `images` field).

A source is a path, relative to the data file's folder, or a `data:image/...;base64,` URL; http(s) is refused
(images.load_image bounds each image's bytes and pixels). Every refusal is a BadRecord, which the reader names by
file:line: a slot without an image left in `images`, an image of `images` without a slot, more images than
`ImageOptions.max_images` or crops than `max_crops` (what one window holds), text that already holds Step-3.7's
image tokens (it would be read as image features).

How an image is placed: each image (part or marker) is replaced, where it stands, by the text of its placeholder
run (images.image_placeholder_text: the crops' `<patch_start>` ... `<im_end>`, one `<im_patch>` per vision
feature), as a text part. A Step-3.7 template writes one `<im_patch>` where a message holds an image and the
release's processor expands it to this same run, so the rendered tokens are the ones inference sees; a template
that renders only text parts (step35's default) places it the same way. After tokenization `image_runs` finds each
run in the ids, whole and in order (a template that changed one is a bad record), and its tokens are never
trained (`untrain_image_tokens`).

The batch contract (`IMAGE_KEYS`, one fixed shape per run, so that windows collate): every window of a run with
`data.images` carries, beside input_ids, labels and position_ids,

* `pixel_values` float32 [max_images, 3, view_size, view_size]: the global views of its images, in order;
* `pixel_values_local` float32 [max_crops, 3, crop_size, crop_size]: their crops, image after image;
* `num_local_patches` int64 [max_images]: the crops of each image;
* `num_images` int64 []: how many of the slots hold an image (the rest, zeros, are padding).

A window holds the images of the records packed in it (a record is never split from its images); the packer starts
a new window when a record's images would not fit the rest (packing.PackedConversations). Text-only windows carry
the same tensors with `num_images` 0. The model takes them through vision.images_of_batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from step35.data.images import (
    CROP_SIZE,
    FEATURE_STRIDE,
    GLOBAL_SIZE,
    MAX_IMAGES_PER_RECORD,
    ImageTokens,
    ProcessedImage,
    image_placeholder_text,
    load_image,
    process_image,
)
from step35.data.readers import BadRecord

IMAGE_KEYS = ("pixel_values", "pixel_values_local", "num_local_patches", "num_images")
IMAGE_PART_TYPES = ("image", "image_url", "input_image")  # content parts that hold (or take) an image
IMAGE_MARKER = "<image>"  # LLaMA-Factory's slot in text, in records with an `images` field
_MARKER = re.compile(re.escape(IMAGE_MARKER))
TOKENS = ImageTokens()  # Step-3.7's image tokens


@dataclass(frozen=True)
class ImageOptions:
    """`data.images`: the image views a run's records are cut into and how many one window holds.

    view_size: the global view's side (the release's processor: 728; the model's `vision_config.image_size`).
    crop_size: a local crop's side (the release: 504). Both multiples of 56, the pixels one vision feature covers.
    max_images: images per window (per sample of a batch); a record with more is a bad record.
    max_crops: crops per window (a 3024-pixel image has up to 36 at the release's sizes).
    """

    view_size: int = GLOBAL_SIZE
    crop_size: int = CROP_SIZE
    max_images: int = 4
    max_crops: int = 36

    def __post_init__(self) -> None:
        for name in ("view_size", "crop_size"):
            side = getattr(self, name)
            if not isinstance(side, int) or side < FEATURE_STRIDE or side % FEATURE_STRIDE:
                raise ValueError(
                    f"data.images.{name}={side!r}: must be a multiple of {FEATURE_STRIDE} (the pixels one vision"
                    " feature covers: 14-pixel patches, two stride-2 downsamplers)"
                )
        if not isinstance(self.max_images, int) or not 1 <= self.max_images <= MAX_IMAGES_PER_RECORD:
            raise ValueError(f"data.images.max_images={self.max_images!r}: must be in [1, {MAX_IMAGES_PER_RECORD}]")
        if not isinstance(self.max_crops, int) or self.max_crops < 0:
            raise ValueError(f"data.images.max_crops={self.max_crops!r}: must be >= 0")

    @classmethod
    def of(cls, value: Any) -> ImageOptions | None:
        """None (no images), an ImageOptions, or a mapping of its fields (a config's `data.images: {...}`)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(
                    f"data.images: unknown field(s) {unknown}; the fields: {list(cls.__dataclass_fields__)}"
                )
            return cls(**value)
        raise ValueError(f"data.images: expected a mapping of {list(cls.__dataclass_fields__)}, got {value!r}")


# ---------------------------------------------------------------------------------------------- the record


class _Slots:
    """The images of one record as they are met: decoded, processed, and their placeholder text given out."""

    def __init__(self, column: list | None, base_dir: Path, options: ImageOptions, tokens: ImageTokens):
        self.column, self.taken = column, 0
        self.base_dir, self.options, self.tokens = base_dir, options, tokens
        self.images: list[ProcessedImage] = []

    def placeholder(self, source: Any, what: str) -> str:
        """The placeholder text of the image `source` names (None: the next of the `images` field)."""
        if source is None:
            if self.column is None or self.taken >= len(self.column):
                given = 0 if self.column is None else len(self.column)
                raise BadRecord(
                    f"{what} takes an image from the record's 'images', which holds {given}: more image slots than"
                    " images"
                )
            source, self.taken = self.column[self.taken], self.taken + 1
        if len(self.images) >= self.options.max_images:
            raise BadRecord(
                f"more than {self.options.max_images} images; a window holds data.images.max_images ="
                f" {self.options.max_images}"
            )
        processed = process_image(load_image(source, self.base_dir), self.options.view_size, self.options.crop_size)
        self.images.append(processed)
        crops = sum(image.n_crops for image in self.images)
        if crops > self.options.max_crops:
            raise BadRecord(
                f"its images have {crops} crops; a window holds data.images.max_crops = {self.options.max_crops}"
            )
        return image_placeholder_text(processed, self.tokens)

    def text(self, text: str, what: str) -> str:
        """`text` with each `<image>` marker replaced (only in a record with an `images` field)."""
        if self.column is None or IMAGE_MARKER not in text:
            return text
        return _MARKER.sub(lambda _: self.placeholder(None, what), text)


def record_images(
    value: dict, messages: Any, base_dir: str | Path, options: ImageOptions, tokens: ImageTokens = TOKENS
) -> tuple[Any, list[ProcessedImage]]:
    """(the messages with every image replaced by its placeholder run as text, the images in order) of a record
    `value` whose conversation is `messages`; BadRecord as the module docstring lists. Messages that are not a
    list of objects are given back as they are (check_messages says what is wrong with them)."""
    column = value.get("images") if isinstance(value, dict) else None
    if column is not None and not (isinstance(column, list) and all(isinstance(c, str) for c in column)):
        raise BadRecord(f"'images' must be a list of paths or data: URLs, got {type(column).__name__}")
    if column is not None and len(column) > MAX_IMAGES_PER_RECORD:
        raise BadRecord(f"'images' lists {len(column)} images, over the limit of {MAX_IMAGES_PER_RECORD} per record")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages, []
    _refuse_image_tokens(messages, tokens)
    slots = _Slots(column, Path(base_dir), options, tokens)
    placed = [_message_with_images(message, i, slots) for i, message in enumerate(messages)]
    if column is not None and slots.taken < len(column):
        raise BadRecord(
            f"'images' lists {len(column)} images but the conversation has {slots.taken} image slots (image parts"
            f" without a source, {IMAGE_MARKER} markers): more images than placeholders"
        )
    return placed, slots.images


def _message_with_images(message: dict, index: int, slots: _Slots) -> dict:
    content = message.get("content")
    what = f"message {index} ({message.get('role')})"
    if isinstance(content, str):
        return {**message, "content": slots.text(content, what)}
    if not isinstance(content, list):
        return message
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES:
            text = slots.placeholder(_part_source(part, f"{what} content part {k}"), f"{what} content part {k}")
            parts.append({"type": "text", "text": text})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({**part, "text": slots.text(part["text"], f"{what} content part {k}")})
        else:
            parts.append(part)  # check_messages refuses what is not text (a video stops the run)
    return {**message, "content": parts}


def _part_source(part: dict, what: str) -> Any:
    """The image an image part names (None: it takes the next of `images`)."""
    if part["type"] == "image":
        sources = [part[key] for key in ("image", "url", "path") if part.get(key) is not None]
        return sources[0] if sources else None
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if url is None:
        raise BadRecord(f"{what} ({part['type']!r}) has no image_url.url")
    return url


def _refuse_image_tokens(messages: list, tokens: ImageTokens) -> None:
    """A record whose text already holds an image token would get image features where it stands: refused."""
    names = list(vars(tokens).values())
    for i, message in enumerate(messages):
        for text in _texts(message.get("content")):
            found = next((name for name in names if name in text), None)
            if found is not None:
                raise BadRecord(
                    f"message {i} ({message.get('role')}) holds {found!r}, one of Step-3.7's image tokens, as text;"
                    " an image is given as an image part or an <image> marker with the record's 'images'"
                )


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


# ---------------------------------------------------------------------------------------------- the tokens


def run_ids(image: ProcessedImage, ids: dict[str, int], tokens: ImageTokens = TOKENS) -> list[int]:
    """The token ids of an image's placeholder run (`ids`: ImageTokens.ids of the tokenizer), as
    image_placeholder_text tokenizes."""
    crop = [ids[tokens.patch_start]] + [ids[tokens.image]] * image.crop_features + [ids[tokens.patch_end]]
    out: list[int] = []
    for row in range(image.rows):
        if row:
            out.append(ids[tokens.patch_newline])
        out += crop * image.columns
    return out + [ids[tokens.image_start]] + [ids[tokens.image]] * image.global_features + [ids[tokens.image_end]]


def image_runs(
    token_ids: list[int], images: list[ProcessedImage], ids: dict[str, int], complete: bool
) -> tuple[int, ...]:
    """Where each image's placeholder run starts in `token_ids`, for the images whose run lies wholly within them
    (all of them when `complete`, else those before the cut). BadRecord when a run is not there as it was placed
    (the chat template changed or dropped it)."""
    image_token_ids = set(ids.values())
    starts, at = [], 0
    for k, image in enumerate(images):
        expected = run_ids(image, ids)
        while at < len(token_ids) and token_ids[at] not in image_token_ids:
            at += 1
        if at + len(expected) > len(token_ids) and not complete:
            break  # cut off by the encoder's limit: the packer cuts before it
        if token_ids[at : at + len(expected)] != expected:
            raise BadRecord(
                f"image {k}'s placeholder run ({len(expected)} tokens) is not in the rendered conversation as it was"
                " placed: the chat template changed or dropped it"
            )
        starts.append(at)
        at += len(expected)
    if complete and any(t in image_token_ids for t in token_ids[at:]):
        raise BadRecord("the rendered conversation holds image tokens past its images' runs")
    return tuple(starts)


def untrain_image_tokens(token_ids: list[int], trained: list[bool], ids: dict[str, int]) -> list[bool]:
    """`trained` with every image token off: image features are inputs, never targets."""
    image_token_ids = set(ids.values())
    return [flag and t not in image_token_ids for t, flag in zip(token_ids, trained)]


# ---------------------------------------------------------------------------------------------- the window


def window_image_tensors(images: list[ProcessedImage], options: ImageOptions) -> tuple[torch.Tensor, ...]:
    """The IMAGE_KEYS tensors of one window holding `images` (in order), zero-padded to the fixed shapes."""
    if len(images) > options.max_images or sum(i.n_crops for i in images) > options.max_crops:
        raise ValueError(f"{len(images)} images do not fit a window's {options.max_images} image slots")
    view, crop = options.view_size, options.crop_size
    pixel_values = torch.zeros(options.max_images, 3, view, view)
    pixel_values_local = torch.zeros(options.max_crops, 3, crop, crop)
    num_local_patches = torch.zeros(options.max_images, dtype=torch.long)
    first = 0
    for i, image in enumerate(images):
        pixel_values[i] = image.pixel_values[0]
        pixel_values_local[first : first + image.n_crops] = image.pixel_values_local
        num_local_patches[i] = image.n_crops
        first += image.n_crops
    return pixel_values, pixel_values_local, num_local_patches, torch.tensor(len(images), dtype=torch.long)


def fits_window(held: list[ProcessedImage], more: list[ProcessedImage], options: ImageOptions) -> bool:
    """Whether a window holding `held` has room for `more` images."""
    images = len(held) + len(more)
    crops = sum(i.n_crops for i in held) + sum(i.n_crops for i in more)
    return images <= options.max_images and crops <= options.max_crops
