"""Images of Step-3.7-Flash's conversations: bounded decoding, the release's preprocessing, and the placeholder text.

Three steps, each a function:

1. `load_image(source, base_dir)` turns what a record names (a path, relative to the data file's folder, or a
   `data:image/...;base64,` URL) into an RGB `PIL.Image`, refusing anything that would cost unbounded memory or
   time: a file over `MAX_IMAGE_BYTES`, a header claiming more than `MAX_IMAGE_PIXELS` (checked before a pixel
   is decoded; Pillow's own decompression-bomb guard is set from the same limit), a truncated file (decoded to
   the end, so a cut file is refused here and not in the middle of a batch), an http(s) URL (training reads no
   network). Every refusal is a `BadRecord` whose one-line message names the image and the problem; the caller
   adds file:line.
2. `process_image(image)` computes what Step-3.7's image processor (transformers' `Step3p7ImageProcessor`)
   computes: a global view of the whole image at 728x728 and zero or more local crops at 504x504, cut on a grid
   whose cell size follows the aspect ratio (`plan_crops`), resized with antialiased bilinear interpolation on
   uint8 pixels as torchvision does on the CPU, then normalised with CLIP's mean and std.
3. `image_placeholder_text(processed)` is the text that stands for the image in the token sequence, as
   Step-3.7's processor expands it: per crop `<patch_start>` + 81 x `<im_patch>` + `<patch_end>` (and a
   `<patch_newline>` after the last crop of every grid row but the last), then `<im_start>` + 169 x `<im_patch>`
   + `<im_end>` for the global view. The image occupies `n_crops*(81+2) + 169+2 + newlines` tokens, the vision
   encoder's features fill the `n_crops*81 + 169` `<im_patch>` positions.

The sizes are the release's by default; `process_image(image, global_size, crop_size)` takes others (a small
model's views, e.g. the `tiny-vl` preset's 112-pixel global view and 56-pixel crops, as transformers' processor takes
`size` and `patch_size`), and the feature counts follow from them: one feature per `FEATURE_STRIDE` pixels a side.

Only the global view is square-padded for near-degenerate images (thinner than 32 px and longer than 4:1), with
black at the bottom and right, as the release does. EXIF orientation is not applied (the release does not).
"""

import base64
import binascii
import contextlib
import io
import platform
import re
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile

from step35.data.readers import BadRecord

# Limits of what one record may bring; a record over them is a bad record, not an out-of-memory error.
MAX_IMAGES_PER_RECORD = 16
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one image file (or the decoded payload of a data: URL)
MAX_IMAGE_PIXELS = 50_000_000  # width x height from the header, before decoding: ~200 MB as RGBA

# Step-3.7-Flash's image processor (transformers' Step3p7ImageProcessor defaults).
GLOBAL_SIZE = 728  # side of the global view
CROP_SIZE = 504  # side of a local crop after its resize
MAX_IMAGE_SIDE = 3024  # a longer image is scaled down uniformly before its crops are planned
THIN_SIDE = 32  # an image thinner than this and longer than 4:1 is padded to a square first
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's, per RGB channel, on the [0, 1] scale
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
RESCALE = 1 / 255
# The vision encoder: 14-px ViT patches, then two stride-2 downsamplers: one feature per 56x56 pixels.
FEATURE_STRIDE = 14 * 4
GLOBAL_FEATURES = (GLOBAL_SIZE // FEATURE_STRIDE) ** 2  # 169
CROP_FEATURES = (CROP_SIZE // FEATURE_STRIDE) ** 2  # 81

# torchvision resizes uint8 images natively where the CPU has the vectorised kernel, else in float32 and rounds.
_NATIVE_UINT8_RESIZE = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
    "aarch64",
    "arm64",
)
# The fused rescale-and-normalise: (pixel - mean*255) / (std*255), in float32.
_MEAN_255 = (torch.tensor(IMAGE_MEAN) * (1.0 / RESCALE)).view(3, 1, 1)
_STD_255 = (torch.tensor(IMAGE_STD) * (1.0 / RESCALE)).view(3, 1, 1)

_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,", re.IGNORECASE)
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class ImageTokens:
    """The special tokens of Step-3.7's processor (`Step3p7Processor`); their ids come from the tokenizer."""

    image: str = "<im_patch>"  # one per vision feature; also the single placeholder a chat template writes
    image_start: str = "<im_start>"
    image_end: str = "<im_end>"
    patch_start: str = "<patch_start>"
    patch_end: str = "<patch_end>"
    patch_newline: str = "<patch_newline>"

    def ids(self, tokenizer: Any) -> dict[str, int]:
        """{token: id} from a tokenizer with `token_to_id` (a `tokenizers.Tokenizer`); each must be one token."""
        ids = {}
        for token in vars(self).values():
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"the tokenizer has no token {token!r}: it is not Step-3.7's (images need it)")
            ids[token] = token_id
        return ids


@dataclass(frozen=True)
class CropPlan:
    """Where the crops of one image come from (sizes are (width, height)); `window == 0`: no crops."""

    square_side: int  # the image is first padded to this square (0: not padded)
    global_size: tuple[int, int]  # resized to this, then to GLOBAL_SIZE x GLOBAL_SIZE, for the global view
    crop_size: tuple[int, int]  # resized to this, then cut into `columns x rows` cells of side `window`
    window: int
    columns: int
    rows: int

    @property
    def n_crops(self) -> int:
        return self.columns * self.rows


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision encoder takes it, and how many tokens it occupies in the sequence."""

    pixel_values: torch.Tensor  # [1, 3, 728, 728] float32: the global view
    pixel_values_local: torch.Tensor  # [n_crops, 3, 504, 504] float32: the crops, row by row
    columns: int  # the crops' grid (0 x 0 without crops)
    rows: int
    global_size: int = GLOBAL_SIZE  # the sides of the global view and of a crop, in pixels
    crop_size: int = CROP_SIZE

    @property
    def n_crops(self) -> int:
        return self.columns * self.rows

    @property
    def newlines(self) -> int:
        """`<patch_newline>` tokens: one after each grid row but the last."""
        return max(self.rows - 1, 0)

    @property
    def global_features(self) -> int:
        """Vision features of the global view: 169 at the release's 728 pixels."""
        return (self.global_size // FEATURE_STRIDE) ** 2

    @property
    def crop_features(self) -> int:
        """Vision features of one crop: 81 at the release's 504 pixels."""
        return (self.crop_size // FEATURE_STRIDE) ** 2

    @property
    def image_token_count(self) -> int:
        """`<im_patch>` tokens, one per vision feature: n_crops*81 + 169."""
        return self.n_crops * self.crop_features + self.global_features

    @property
    def placeholder_count(self) -> int:
        """All the tokens of `image_placeholder_text`: n_crops*(81+2) + 169+2 + newlines."""
        return self.n_crops * (self.crop_features + 2) + self.global_features + 2 + self.newlines


# ---------------------------------------------------------------------------------------------- decoding


def load_image(
    source: Any, base_dir: str | Path, *, max_pixels: int = MAX_IMAGE_PIXELS, max_bytes: int = MAX_IMAGE_BYTES
) -> Image.Image:
    """The RGB image `source` names: a path (relative to `base_dir`, the data file's folder) or a
    `data:image/<type>;base64,` URL. Refusals (`BadRecord`): http(s) and other URLs, a missing or unreadable file,
    over `max_bytes` bytes, over `max_pixels` pixels, not an image, truncated or corrupt."""
    if not isinstance(source, str):
        raise BadRecord(f"an image is given by a path or a data: URL string, not {type(source).__name__}")
    what = f"image {_describe(source)}"
    if _DATA_URL.match(source):
        data = _data_url_bytes(source, what, max_bytes)
    else:
        scheme = _URL_SCHEME.match(source)
        if scheme and scheme.group(1).lower() in ("http", "https"):
            raise BadRecord(f"{what}: no network at training time: download the image and give its path")
        if scheme or source.lower().startswith("data:"):
            raise BadRecord(f"{what}: give a path or a data:image/<type>;base64, URL")
        data = _file_bytes(Path(base_dir) / source, what, max_bytes)
    return to_rgb(_decode(data, what, max_pixels))


def _describe(source: str) -> str:
    """The source as a message names it: a data: URL by its head and length, not its whole payload."""
    if len(source) <= 120:
        return repr(source)
    return f"{source[:40]!r}... ({len(source):,} characters)"


def _data_url_bytes(source: str, what: str, max_bytes: int) -> bytes:
    payload = source[source.index(",") + 1 :]
    if len(payload) // 4 * 3 > max_bytes:  # refused before decoding: base64 holds 3 bytes per 4 characters
        raise BadRecord(f"{what}: about {len(payload) // 4 * 3:,} bytes, over the limit of {max_bytes:,} per image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadRecord(f"{what}: the data: URL is not valid base64 ({error})") from None


def _file_bytes(path: Path, what: str, max_bytes: int) -> bytes:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise BadRecord(f"{what}: {size:,} bytes, over the limit of {max_bytes:,} per image file")
        with path.open("rb") as file:
            data = file.read(size + 1)  # read(n) allocates n bytes: the file's size, not the limit
            if len(data) > size:  # it grew since stat()
                data += file.read(max_bytes + 1 - len(data))
    except FileNotFoundError:
        raise BadRecord(f"{what}: no such file ({path})") from None
    except OSError as error:
        raise BadRecord(f"{what}: cannot read {path}: {error.strerror or error}") from None
    except ValueError as error:  # a NUL in the path
        raise BadRecord(f"{what}: not a valid path ({error})") from None
    if len(data) > max_bytes:
        raise BadRecord(f"{what}: over the limit of {max_bytes:,} bytes per image file")
    return data


@contextlib.contextmanager
def _pillow_limits(max_pixels: int) -> Iterator[None]:
    """Pillow's own guards for the duration of one decode: its decompression-bomb error at twice `max_pixels` (a
    backstop: `_decode` refuses from `max_pixels` on, naming the size, so Pillow's warning there is silenced),
    truncated files refused. Both are process globals, restored afterwards: decode in one thread per process
    (as DataLoader workers do)."""
    saved = Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES
    Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = max_pixels, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = saved


def _decode(data: bytes, what: str, max_pixels: int) -> Image.Image:
    """Decode the whole image (its first frame), refusing it by its header's size before any pixel is decoded."""
    with _pillow_limits(max_pixels):
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise BadRecord(
                    f"{what}: {width}x{height} = {width * height:,} pixels, over the limit of {max_pixels:,} pixels,"
                    " a decompression bomb or an image to shrink first"
                )
            if width == 0 or height == 0:
                raise BadRecord(f"{what}: the image is {width}x{height}: no pixels")
            image.load()  # decode to the end: a truncated or corrupt file fails here
        except Image.DecompressionBombError as error:
            raise BadRecord(
                f"{what}: over the limit of {max_pixels:,} pixels, a decompression bomb or an image to shrink first"
                f" (Pillow: {error})"
            ) from None
        except Image.UnidentifiedImageError:
            raise BadRecord(f"{what}: not an image format Pillow can read ({len(data):,} bytes)") from None
        except (OSError, SyntaxError, ValueError, EOFError, struct.error) as error:
            raise BadRecord(f"{what}: cannot decode it, the file is truncated or corrupt ({error})") from None
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the release converts: transparency (an alpha band or a transparent colour) over white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


# ---------------------------------------------------------------------------------------------- preprocessing


def plan_crops(width: int, height: int, global_size: int = GLOBAL_SIZE, crop_size: int = CROP_SIZE) -> CropPlan:
    """The crops of a `width x height` image: a grid of square windows whose side follows the aspect ratio
    (`global_size`, `crop_size`: the sides of the global view and of a crop)."""
    square_side = max(width, height) if _is_thin(width, height) else 0
    if square_side:
        width = height = square_side
    longest = max(width, height)
    if longest > MAX_IMAGE_SIDE:  # scaled down uniformly (sizes truncated), before the plan
        scale = MAX_IMAGE_SIDE / longest
        width, height = int(width * scale), int(height * scale)
    short, long = min(width, height), max(width, height)
    if long <= global_size:  # the global view holds it: crops only for an elongated image, short side square
        window = short if long / short > 1.5 else 0
    elif long / short > 4:
        window = min(short, crop_size)
    else:
        window = crop_size
    if window == 0:
        return CropPlan(square_side, (width, height), (width, height), 0, 0, 0)
    crop_width, crop_height = _snap(width, window), _snap(height, window)
    columns, rows = max(1, crop_width // window), max(1, crop_height // window)
    return CropPlan(square_side, (width, height), (crop_width, crop_height), window, columns, rows)


def _is_thin(width: int, height: int) -> bool:
    return min(width, height) < THIN_SIDE and max(width / height, height / width) > 4


def _snap(side: int, window: int) -> int:
    """`side` to a whole number of windows: up when the remainder is over a fifth of a window, else down;
    a side shorter than one window stays as it is (its crops are stretched to square)."""
    if side < window:
        return side
    return window * (side // window + (side % window > 0.2 * window))


def process_image(image: Image.Image, global_size: int = GLOBAL_SIZE, crop_size: int = CROP_SIZE) -> ProcessedImage:
    """The global view ([1, 3, global_size, global_size]) and the crops ([n, 3, crop_size, crop_size]) of one image,
    normalised, as Step-3.7's image processor makes them (its `size` and `patch_size`)."""
    pixels = _to_uint8_tensor(to_rgb(image))  # [1, 3, H, W]
    _, _, height, width = pixels.shape
    plan = plan_crops(width, height, global_size, crop_size)
    if plan.square_side:  # black at the bottom and right
        pixels = F.pad(pixels, (0, plan.square_side - width, 0, plan.square_side - height))
    global_view = _resize(_resize(pixels, plan.global_size), (global_size, global_size))
    crops = torch.empty(0, 3, crop_size, crop_size, dtype=torch.uint8)
    if plan.window:
        grid = _resize(pixels, plan.crop_size)
        w = plan.window
        cells = [
            grid[0, :, r * w : (r + 1) * w, c * w : (c + 1) * w] for r in range(plan.rows) for c in range(plan.columns)
        ]
        crops = _resize(torch.stack(cells), (crop_size, crop_size))
    return ProcessedImage(_normalize(global_view), _normalize(crops), plan.columns, plan.rows, global_size, crop_size)


def _to_uint8_tensor(image: Image.Image) -> torch.Tensor:
    """[1, 3, H, W] uint8 of an RGB image."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous().unsqueeze(0)


def _resize(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of uint8 [N, 3, H, W] to `size` = (width, height), as torchvision does it."""
    width, height = size
    if pixels.shape[-2:] == (height, width):
        return pixels
    if _NATIVE_UINT8_RESIZE:
        return F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    resized = F.interpolate(pixels.float(), size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return resized.round_().to(torch.uint8)


def _normalize(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.to(torch.float32).sub_(_MEAN_255).div_(_STD_255)


# ---------------------------------------------------------------------------------------------- placeholder text


def image_placeholder_text(processed: ProcessedImage, tokens: ImageTokens = ImageTokens()) -> str:
    """The text that stands for one image in the sequence (Step-3.7's expansion of its `<im_patch>`): the crops
    row by row, each between `patch_start` and `patch_end` with a `patch_newline` closing every row but the last,
    then the global view between `image_start` and `image_end`. Tokenized, it is `placeholder_count` tokens."""
    crop = tokens.patch_start + tokens.image * processed.crop_features + tokens.patch_end
    rows = [crop * processed.columns for _ in range(processed.rows)]
    whole = tokens.image_start + tokens.image * processed.global_features + tokens.image_end
    return tokens.patch_newline.join(rows) + whole
