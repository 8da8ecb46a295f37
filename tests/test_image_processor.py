"""step35/data/images.py against Step-3.7-Flash's processor in transformers 5.24 (.oracle), and its refusals.

The oracle's pixels need torchvision, which .oracle cannot hold on its path: PyPI's torchvision is a CUDA build,
its ops library does not load against the CPU torch, and `import torchvision` then fails, which would break every
test that imports transformers' Step3p7 modeling. So it lies apart, in .oracle/_torchvision
(`pip install --no-deps --target .oracle/_torchvision torchvision==0.28.0`), and the oracle runs in a process of
its own that declares the two ops torchvision's import registers fake kernels for (nms, qnms; nothing here runs
them) and imports it from there. Without that folder the pixel tests skip; the planner, placeholder and refusal
tests need only transformers.

Tolerances: pixels within 1e-6 (they are equal: the same uint8 kernel, the same float32 normalisation), counts
and placeholder text exactly.
"""

import base64
import ctypes
import io
import json
import os
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from step35.data import images
from step35.data.images import (
    CROP_FEATURES,
    GLOBAL_FEATURES,
    ImageTokens,
    ProcessedImage,
    image_placeholder_text,
    load_image,
    plan_crops,
    process_image,
)
from step35.data.readers import BadRecord

ORACLE = Path(__file__).parent.parent / ".oracle"
TORCHVISION = ORACLE / "_torchvision"
TOKENS = ImageTokens()

# name: (width, height, format, mode); the crops each gives are checked against the oracle, and named here.
CASES = {
    "square_0_crops": (300, 300, "PNG", "RGB"),
    "tiny_0_crops": (5, 5, "PNG", "RGB"),
    "thin_padded_0_crops": (12, 100, "PNG", "RGB"),  # padded to 100x100 first
    "wide_in_global_4_crops": (700, 200, "PNG", "RGB"),  # fits 728: cells of its short side
    "wide_2_crops": (1000, 600, "JPEG", "RGB"),
    "tall_3_crops_column": (600, 1200, "PNG", "RGB"),
    "wide_6_crops_3x2": (1500, 1000, "JPEG", "RGB"),
    "short_side_under_a_cell": (800, 300, "PNG", "RGB"),  # 504x300 cells stretched to square
    "very_wide_8_crops": (3100, 400, "JPEG", "RGB"),  # over 4:1: cells of min(short side, 504)
    "thin_padded_16_crops": (2000, 20, "PNG", "RGB"),
    "huge_30_crops": (4000, 3000, "JPEG", "RGB"),  # 12 Mpx, scaled to 3024 first
    "rgba_transparent": (900, 500, "PNG", "RGBA"),  # alpha composited over white
    "grayscale": (640, 480, "PNG", "L"),
    "palette": (500, 900, "PNG", "P"),
}
FLOAT_PATH_CASES = ["wide_6_crops_3x2", "tall_3_crops_column", "thin_padded_0_crops"]


def draw_image(width: int, height: int, seed: int, mode: str) -> Image.Image:
    """Shapes and colours over a gradient, with a band of seeded noise (edges and texture for the resize)."""
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for k in range(6):
        box = [width * k // 7, height * (k % 3) // 4, width * (k + 2) // 7, height * (k % 3 + 2) // 4]
        colour = ((53 * k + seed) % 256, (97 * k + 3 * seed) % 256, (151 * k + 7 * seed) % 256)
        (draw.ellipse if k % 2 else draw.rectangle)(box, fill=colour)
    draw.line([(0, 0), (width - 1, height - 1)], fill=(255, 0, 0), width=3)
    band = max(1, min(height, 64))
    noise = torch.randint(0, 256, (band, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    image.paste(Image.frombytes("RGB", (width, band), noise.numpy().tobytes()), (0, height // 2 - band // 2))
    if mode == "RGBA":
        alpha = Image.linear_gradient("L").resize((width, height))
        image.putalpha(alpha)
    elif mode in ("L", "P"):
        image = image.convert(mode)
    return image


@pytest.fixture(scope="module")
def case_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("images")
    files = {}
    for seed, (name, (width, height, fmt, mode)) in enumerate(CASES.items()):
        files[name] = folder / f"{name}.{fmt.lower()}"
        draw_image(width, height, seed, mode).save(
            files[name], format=fmt, **({"quality": 90} if fmt == "JPEG" else {})
        )
    return files


# ---------------------------------------------------------------------------------------------- the oracle

# Runs in its own process (the module docstring says why). argv: manifest.json (name -> path), out.pt.
ORACLE_SCRIPT = r"""
import json, platform, sys
sys.path.append(sys.argv[3]); sys.path.append(sys.argv[4])
import torch
ops = torch.library.Library("torchvision", "DEF")  # what torchvision's import registers fake kernels for
ops.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
ops.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor
from transformers.models.step3p7.processing_step3p7 import Step3p7Processor

special = ["<unk>", "<im_patch>", "<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"]
vocab = {token: i for i, token in enumerate(special + ["before", "after"])}
tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer.add_special_tokens(special)
image_processor = Step3p7ImageProcessor()
processor = Step3p7Processor(image_processor, PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>"))
manifest = json.loads(open(sys.argv[1]).read())
results = {}
for name, path in manifest["cases"].items():
    image = Image.open(path)
    out = processor(text=[f"before {processor.image_token} after"], images=[image], return_tensors="pt")
    tokens = processor.tokenizer.convert_ids_to_tokens(out["input_ids"][0].tolist())
    assert tokens[0] == "before" and tokens[-1] == "after", tokens[:3]
    results[name] = {
        "pixel_values": out["pixel_values"], "pixel_values_local": out.get("pixel_values_local"),
        "num_local_patches": int(out["num_local_patches"][0]), "image_tokens": tokens[1:-1],
    }
# torchvision's float32-then-round resize, as on a CPU without AVX2
torch.backends.cpu.get_cpu_capability = lambda: "DEFAULT"
platform.machine = lambda: "x86_64"
for name in manifest["float_cases"]:
    out = image_processor(Image.open(manifest["cases"][name]), return_tensors="pt")
    results[name]["float_path"] = (out["pixel_values"], out.get("pixel_values_local"))
torch.save(results, sys.argv[2])
"""


@pytest.fixture(scope="module")
def oracle(case_files, tmp_path_factory) -> dict:
    if not (TORCHVISION / "torchvision").is_dir():
        pytest.skip(
            f"no torchvision in {TORCHVISION} for the pixel oracle: "
            "pip install --no-deps --target .oracle/_torchvision torchvision==0.28.0"
        )
    folder = tmp_path_factory.mktemp("oracle")
    manifest = {"cases": {name: str(path) for name, path in case_files.items()}, "float_cases": FLOAT_PATH_CASES}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    out = folder / "out.pt"
    command = [sys.executable, "-c", ORACLE_SCRIPT, *map(str, (folder / "manifest.json", out, ORACLE, TORCHVISION))]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"}
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def assert_pixels_equal(ours: ProcessedImage, theirs_global: torch.Tensor, theirs_local, name: str) -> None:
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == theirs_global.shape == (1, 3, 728, 728), name
    torch.testing.assert_close(ours.pixel_values, theirs_global, atol=1e-6, rtol=0, msg=f"{name}: global view")
    if theirs_local is None:
        assert ours.pixel_values_local.shape == (0, 3, 504, 504), name
    else:
        assert ours.pixel_values_local.shape == theirs_local.shape, name
        torch.testing.assert_close(ours.pixel_values_local, theirs_local, atol=1e-6, rtol=0, msg=f"{name}: crops")


@pytest.mark.heavy  # the oracle is a process of its own (~7 s of CPU)
@pytest.mark.parametrize("name", list(CASES))
def test_pixels_and_placeholder_equal_the_release_processor(name, case_files, oracle):
    """Each image: the global view and crops within 1e-6 of Step3p7Processor's, the same number of crops, and the
    placeholder text equal, token for token, to the processor's expansion of its image token."""
    theirs = oracle[name]
    ours = process_image(load_image(case_files[name].name, case_files[name].parent))
    assert ours.n_crops == theirs["num_local_patches"], name
    assert_pixels_equal(ours, theirs["pixel_values"], theirs["pixel_values_local"], name)
    tokens = theirs["image_tokens"]
    assert "".join(tokens) == image_placeholder_text(ours, TOKENS), name
    assert len(tokens) == ours.placeholder_count, name
    assert tokens.count("<im_patch>") == ours.image_token_count, name
    # the formula, from the processor's own counts
    newlines = tokens.count("<patch_newline>")
    assert newlines == ours.newlines == max(ours.rows - 1, 0), name
    assert len(tokens) == theirs["num_local_patches"] * (81 + 2) + 169 + 2 + newlines, name


@pytest.mark.heavy  # the oracle is a process of its own (~7 s of CPU)
def test_the_cases_cover_0_and_several_crops(case_files, oracle):
    """The cases' crop counts as named (1 crop is not reachable: test_crop_plan_equals_the_release)."""
    counts = {name: oracle[name]["num_local_patches"] for name in CASES}
    assert counts["square_0_crops"] == counts["tiny_0_crops"] == counts["thin_padded_0_crops"] == 0
    assert (counts["wide_2_crops"], counts["tall_3_crops_column"], counts["wide_6_crops_3x2"]) == (2, 3, 6)
    assert (counts["thin_padded_16_crops"], counts["huge_30_crops"]) == (16, 30)


@pytest.mark.heavy  # the oracle is a process of its own (~7 s of CPU)
def test_float_resize_path_equals_torchvision_without_avx2(case_files, oracle, monkeypatch):
    """On a CPU without the uint8 kernel torchvision resizes in float32 and rounds; so does step35 (the two paths
    differ by one level on ~17% of pixels, so this can fail)."""
    monkeypatch.setattr(images, "_NATIVE_UINT8_RESIZE", False)
    for name in FLOAT_PATH_CASES:
        ours = process_image(load_image(str(case_files[name]), "/nonexistent"))  # absolute: base_dir unused
        assert_pixels_equal(ours, *oracle[name]["float_path"], name)


# ---------------------------------------------------------------------------------------------- planner and text


def release_image_processor():
    module = pytest.importorskip("transformers.models.step3p7.image_processing_step3p7")
    return module.Step3p7ImageProcessor()


def test_crop_plan_equals_the_release():
    """plan_crops against the release's planner (pure Python: no torchvision) on ~5k sizes from 1 px to 5000 px,
    every field; and no size gives exactly one crop: a long side over 728 px spans over 1.2 cells of 504 (over 4:1,
    4 cells of the short side), an elongated side within 728 px over 1.2 cells of the short side, and a cell count
    over 1.2 rounds up."""
    release = release_image_processor()
    generator = torch.Generator().manual_seed(0)
    sizes = [(w, h) for w in range(1, 1600, 29) for h in range(1, 1600, 23)]
    sizes += [tuple(pair) for pair in torch.randint(1, 5001, (2000, 2), generator=generator).tolist()]
    sizes += [(1, 5000), (5000, 1), (31, 200), (32, 200), (3024, 3024), (3025, 3025), (728, 485), (728, 486)]
    for width, height in sizes:
        plan = plan_crops(width, height)
        theirs = release._plan_patches(width, height, 728, 504)
        ours = (plan.global_size, plan.crop_size, plan.window, plan.columns, plan.rows, plan.square_side > 0)
        assert ours == theirs, (width, height)
        assert plan.n_crops == release.get_number_of_image_patches(height, width)
        assert plan.n_crops != 1, (width, height)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<unk>", *vars(TOKENS).values()]
    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(special)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(special)
    return tokenizer


@pytest.mark.parametrize("grid", [(0, 0), (2, 1), (1, 3), (3, 2), (4, 4), (6, 5)])
def test_placeholder_text_counts(grid):
    """The text tokenizes to n_crops*(81+2) + 169+2 + (rows-1) tokens, n_crops*81 + 169 of them <im_patch>, in the
    order the release writes: the crops row by row, a newline after each row but the last, the global view last."""
    columns, rows = grid
    processed = ProcessedImage(torch.empty(0), torch.empty(0), columns, rows)
    text = image_placeholder_text(processed)
    ids = word_tokenizer().encode(text, add_special_tokens=False).ids
    newlines = max(rows - 1, 0)
    assert len(ids) == processed.placeholder_count == columns * rows * (81 + 2) + 169 + 2 + newlines
    token_ids = TOKENS.ids(word_tokenizer())
    assert (
        ids.count(token_ids["<im_patch>"])
        == processed.image_token_count
        == columns * rows * CROP_FEATURES + GLOBAL_FEATURES
    )
    assert ids.count(token_ids["<patch_newline>"]) == newlines
    crop = "<patch_start>" + "<im_patch>" * 81 + "<patch_end>"
    expected = "".join(
        crop + ("<patch_newline>" if c == columns - 1 and r < rows - 1 else "")
        for r in range(rows)
        for c in range(columns)
    )
    assert text == expected + "<im_start>" + "<im_patch>" * 169 + "<im_end>"


def test_image_tokens_ids_refuse_a_tokenizer_without_them():
    from tokenizers import Tokenizer, models

    with pytest.raises(ValueError, match="no token '<im_patch>'"):
        TOKENS.ids(Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    assert sorted(TOKENS.ids(word_tokenizer()).values()) == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------------------------- decoding


def png_bytes(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    draw_image(width, height, 1, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def claim_size(png: bytes, width: int, height: int) -> bytes:
    """The PNG with its IHDR claiming width x height, the chunk's CRC recomputed (a decompression bomb's header)."""
    assert png[12:16] == b"IHDR"
    ihdr = struct.pack(">II", width, height) + png[24:29]
    return png[:16] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + png[33:]


def peak_rss_growth(action) -> int:
    """Bytes the process's peak resident memory grew by during `action` (Linux: the peak is reset first)."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("no /proc/self/status to read the peak resident memory from")

    def kilobytes(field: str) -> int:
        return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith(field))

    try:  # memory freed by earlier tests but still resident would hide a new allocation: give it back first
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError as error:
        pytest.skip(f"cannot reset the peak resident memory: {error}")
    before = kilobytes("VmHWM:")
    action()
    return (kilobytes("VmHWM:") - before) * 1024


def test_decompression_bomb_refused_from_its_header_in_bounded_memory(tmp_path):
    """A 64x64 PNG whose header claims 100000 x 100000 (30 GB as RGB) is refused before decoding: the peak RSS
    grows by under 20 MB and Python allocates under 1 MB while refusing it (measured here: 8 kB and 18 kB)."""
    path = tmp_path / "bomb.png"
    path.write_bytes(claim_size(png_bytes(64, 64), 100_000, 100_000))

    def refuse():
        with pytest.raises(BadRecord, match="bomb.png': .*over the limit of 50,000,000 pixels, a decompression bomb"):
            load_image("bomb.png", tmp_path)

    tracemalloc.start()
    growth = peak_rss_growth(refuse)
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert growth < 20 * 2**20, f"peak RSS grew by {growth / 2**20:.1f} MB refusing a bomb"
    assert python_peak < 2**20, python_peak


def test_a_real_bomb_is_refused_before_its_pixels_exist(tmp_path):
    """A valid 6000x6000 PNG of one grey (36 Mpx, 48 kB on disk): refused at max_pixels=20M, the peak RSS grows
    by under 10 MB (measured 4 kB); decoded at max_pixels=40M, it grows by over 30 MB (measured 171 MB: the
    pixels and their RGB copy). So the measure sees a decode, and the refusal comes before it."""
    buffer = io.BytesIO()
    Image.new("L", (6000, 6000), 128).save(buffer, format="PNG")
    (tmp_path / "grey.png").write_bytes(buffer.getvalue())
    assert len(buffer.getvalue()) < 200_000

    def refuse():
        with pytest.raises(BadRecord, match="6000x6000 = 36,000,000 pixels, over the limit of 20,000,000 pixels"):
            load_image("grey.png", tmp_path, max_pixels=20_000_000)

    assert peak_rss_growth(refuse) < 10 * 2**20
    assert peak_rss_growth(lambda: load_image("grey.png", tmp_path, max_pixels=40_000_000)) > 30 * 2**20


def test_pillow_guard_at_the_limit_and_restored(tmp_path):
    """Over max_pixels step35 refuses from the header's size; over twice it Pillow's own guard, set from
    max_pixels during the decode, refuses first. The guard is put back afterwards."""
    (tmp_path / "a.png").write_bytes(png_bytes(40, 40))
    saved = Image.MAX_IMAGE_PIXELS
    with pytest.raises(BadRecord, match=r"'a.png': 40x40 = 1,600 pixels, over the limit of 1,000 pixels"):
        load_image("a.png", tmp_path, max_pixels=1000)
    assert Image.MAX_IMAGE_PIXELS == saved
    with pytest.raises(BadRecord, match=r"'a.png': over the limit of 700 pixels, .*\(Pillow: Image size \(1600 "):
        load_image("a.png", tmp_path, max_pixels=700)
    assert Image.MAX_IMAGE_PIXELS == saved
    assert load_image("a.png", tmp_path, max_pixels=1600).size == (40, 40)
    assert Image.MAX_IMAGE_PIXELS == saved


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_refused(tmp_path, fmt):
    buffer = io.BytesIO()
    draw_image(400, 300, 2, "RGB").save(buffer, format=fmt)
    (tmp_path / "cut").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(BadRecord, match="image 'cut': cannot decode it, the file is truncated or corrupt"):
        load_image("cut", tmp_path)


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("missing.png", r"image 'missing.png': no such file \(.*missing.png\)"),
        ("http://example.com/a.png", "no network at training time: download the image and give its path"),
        ("HTTPS://example.com/a.png", "no network at training time: download the image and give its path"),
        ("s3://bucket/a.png", "give a path or a data:image/<type>;base64, URL"),
        ("data:image/png;base64,@@not base64@@", "the data: URL is not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "give a path or a data:image/<type>;base64, URL"),
        ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "not an image format Pillow"),
        (".", "cannot read"),
        ("a\x00.png", "not a valid path"),
        (None, "an image is given by a path or a data: URL string, not NoneType"),
    ],
)
def test_bad_sources_refused(tmp_path, source, problem):
    with pytest.raises(BadRecord, match=problem):
        load_image(source, tmp_path)


def test_byte_limits(tmp_path):
    data = png_bytes(200, 200)
    (tmp_path / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    with pytest.raises(BadRecord, match=f"{len(data):,} bytes, over the limit of 1,000 per image file"):
        load_image("a.png", tmp_path, max_bytes=1000)
    with pytest.raises(BadRecord, match="over the limit of 1,000 per image"):
        load_image(url, tmp_path, max_bytes=1000)
    with pytest.raises(BadRecord, match=r"image 'data:image/png;base64,.*\.\.\. \([\d,]+ characters\)"):
        load_image(url, tmp_path, max_bytes=1000)  # a long URL is named by its head, not its payload
    assert load_image(url, tmp_path, max_bytes=len(data)).size == (200, 200)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_data_url_decodes_to_the_file_pixels(tmp_path, fmt):
    path = tmp_path / "sub" / f"a.{fmt.lower()}"
    path.parent.mkdir()
    draw_image(320, 200, 3, "RGB").save(path, format=fmt)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(path.read_bytes()).decode()
    from_file = load_image(f"sub/a.{fmt.lower()}", tmp_path)  # relative to the data file's folder
    from_url = load_image(url, "/nonexistent")
    assert from_file.mode == from_url.mode == "RGB"
    assert from_file.tobytes() == from_url.tobytes() and from_file.size == (320, 200)


def test_transparency_over_white(tmp_path):
    """An RGBA pixel of alpha a and colour c becomes c*a + 255*(1-a) (rounded), as the release composites."""
    image = Image.new("RGBA", (4, 1))
    image.putdata([(0, 0, 0, 0), (0, 0, 0, 255), (200, 100, 0, 128), (10, 20, 30, 64)])
    image.save(tmp_path / "t.png")
    loaded = load_image("t.png", tmp_path)
    pixels = [loaded.getpixel((x, 0)) for x in range(4)]
    rgba = [image.getpixel((x, 0)) for x in range(4)]
    expected = [tuple(round(c * a / 255 + 255 * (1 - a / 255)) for c in rgb) for *rgb, a in rgba]
    assert all(abs(p - e) <= 1 for got, want in zip(pixels, expected, strict=True) for p, e in zip(got, want))
    assert pixels[:2] == [(255, 255, 255), (0, 0, 0)]


def test_limits_are_exported():
    assert images.MAX_IMAGES_PER_RECORD == 16
    assert images.MAX_IMAGE_BYTES == 20 * 2**20 and images.MAX_IMAGE_PIXELS == 50_000_000
