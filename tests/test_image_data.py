"""Conversations with images as training data (step35/data/image_records.py and its use in sft.py, packing.py,
stream.py): the three ways a record names its images, where their placeholder runs land in the tokens, what is
trained, how windows and batches carry the pixels, exact resume, and the bad records.

Independent references: the pixels are images.process_image of the file read with Pillow here; the run of each
image is its placeholder text (images.image_placeholder_text) tokenized by the tokenizer itself; the trained
tokens are decoded and compared with the assistant's text; the crop counts and the placeholder text at the small
sizes used here (112-pixel views, 56-pixel crops) are transformers' Step3p7 processor's (.oracle)."""

from __future__ import annotations

import base64
import copy
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from step35.data.bad_records import BadRecordError
from step35.data.builtin import builtin_tokenizer_dir
from step35.data.chat_messages import ImagesNotSupported
from step35.data.chat_template import ChatTemplate
from step35.data.image_records import IMAGE_KEYS, ImageOptions
from step35.data.images import ImageTokens, image_placeholder_text, plan_crops, process_image
from step35.data.packing import IGNORE_INDEX
from step35.data.spec import SourceSpec, open_source
from step35.data.stream import TokenWindows
from step35.data.tokenizer import TextTokenizer

OPTIONS = ImageOptions(view_size=112, crop_size=56, max_images=3, max_crops=12)
TOKENS = ImageTokens()


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    """The built-in tokenizer with Step-3.7's image tokens (ids 1000-1005 after 1000 BPE tokens)."""
    return TextTokenizer.from_folder(builtin_tokenizer_dir(1000, tmp_path_factory.mktemp("cache"), image_tokens=True))


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate.default().with_tokens(eos_token="<|endoftext|>")


def draw(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> Path:
    image = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(image).ellipse([size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4], fill=colour)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def stream_of(path: Path, tok, template, seq_len: int = 160, images=OPTIONS, strict: bool = True, **kwargs):
    source = open_source(SourceSpec(path=str(path)), "text", "file", None, shuffle=False, seed=0, format="chat")
    return TokenWindows(
        [source], tok, seq_len, endless=False, strict=strict, template=template, images=images, **kwargs
    )


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def ids_of(tok, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def find(haystack: list[int], needle: list[int], start: int = 0) -> int:
    for i in range(start, len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def assistant(value: str) -> dict:
    return {"role": "assistant", "content": value}


# ---------------------------------------------------------------------------------------------- the forms


def test_every_form_places_its_images_where_they_stand_and_trains_the_reply_only(tmp_path, tok, template):
    """Image part with a path (relative to the data file), image_url with a data: URL, a TRL image part taking
    the `images` field, LLaMA-Factory's <image> marker: each run is where the image stood, with the pixels of
    its file, and only the assistant's reply and its EOS are trained."""
    folder = tmp_path / "set"
    red = draw(folder / "img" / "red.png", (90, 70), (220, 20, 20))
    wide = draw(folder / "img" / "wide.png", (150, 40), (20, 20, 220))  # wider than 1.5:1 inside a view: crops
    records = [
        {"messages": [user(text("A"), {"type": "image", "image": "img/red.png"}, text("B")), assistant("red.")]},
        {"messages": [user({"type": "image_url", "image_url": {"url": data_url(wide)}}, text("C")), assistant("wide")]},
        {"messages": [user({"type": "image"}, text("D")), assistant("trl")], "images": ["img/wide.png"]},
        {"messages": [{"role": "user", "content": "E<image>F"}, assistant("lf")], "images": ["img/red.png"]},
    ]
    write(folder / "data.jsonl", records)
    stream = stream_of(folder / "data.jsonl", tok, template, seq_len=120, images=ImageOptions(112, 56, 1, 12))
    windows = list(stream)
    assert len(windows) == 4  # one image slot per window: one record each
    files = [red, wide, wide, red]
    before = ["A", "", "", "E"]
    replies = ["red.", "wide", "trl", "lf"]
    for window, path, head, reply in zip(windows, files, before, replies):
        expected = process_image(Image.open(path), 112, 56)
        assert int(window["num_images"]) == 1
        torch.testing.assert_close(window["pixel_values"][0], expected.pixel_values[0], atol=0, rtol=0)
        crops = expected.n_crops
        assert int(window["num_local_patches"][0]) == crops and (crops > 0) == (path == wide)
        torch.testing.assert_close(window["pixel_values_local"][:crops], expected.pixel_values_local, atol=0, rtol=0)
        assert not window["pixel_values_local"][crops:].any() and window["pixel_values"].shape == (1, 3, 112, 112)
        ids = window["input_ids"].tolist()
        run = ids_of(tok, image_placeholder_text(expected, TOKENS))
        at = find(ids, run)
        assert at > 0 and find(ids, run, at + 1) == -1, "the run, once"
        assert find(ids, ids_of(tok, f"<|user|>\n{head}")) == at - len(ids_of(tok, f"<|user|>\n{head}"))
        image_ids = set(TOKENS.ids(tok.tokenizer).values())
        assert sum(t == 1000 for t in ids) == expected.image_token_count  # the features the splice fills
        labels = window["labels"].tolist()
        trained = [t for t in labels if t != IGNORE_INDEX]
        assert tok.tokenizer.decode(trained, skip_special_tokens=False) == reply + "<|endoftext|>"
        assert not any(t in image_ids for t in trained)


def test_crop_counts_and_placeholders_equal_the_release_processor_at_small_sizes():
    """plan_crops and image_placeholder_text at 112-pixel views and 56-pixel crops, against transformers'
    Step3p7ImageProcessor (size 112, patch_size 56) and Step3p7Processor's expansion."""
    processing = pytest.importorskip("transformers.models.step3p7.image_processing_step3p7")
    from transformers.models.step3p7.processing_step3p7 import Step3p7Processor

    processor = processing.Step3p7ImageProcessor(size={"height": 112, "width": 112}, patch_size=56)
    expand = Step3p7Processor.__new__(Step3p7Processor)
    expand.image_token = "<im_patch>"
    expand.patch_feature_placeholder, expand.image_feature_placeholder = "<im_patch>", "<im_patch>" * 4
    for width, height in [(100, 100), (150, 40), (400, 300), (60, 200), (1000, 90), (20, 300)]:
        plan = plan_crops(width, height, 112, 56)
        assert plan.n_crops == processor.get_number_of_image_patches(height, width), (width, height)
        processed = process_image(Image.new("RGB", (width, height)), 112, 56)
        assert (processed.columns, processed.rows) == (plan.columns, plan.rows)
        masks = [c == plan.columns - 1 and r < plan.rows - 1 for r in range(plan.rows) for c in range(plan.columns)]
        theirs = expand.replace_image_token({"num_local_patches": [plan.n_crops], "patch_newline_masks": [masks]}, 0)
        assert image_placeholder_text(processed, TOKENS) == theirs, (width, height)


# ---------------------------------------------------------------------------------------------- windows


def test_windows_pack_records_with_their_images_and_collate(tmp_path, tok, template):
    """Records are packed whole with their images (a record whose images would overflow the window's image
    slots starts the next window); text-only records train beside them; batches collate to fixed shapes."""
    red = draw(tmp_path / "red.png", (80, 80), (200, 0, 0))
    two = {"messages": [user(text("two"), {"type": "image", "image": "red.png"}, {"type": "image", "image": "red.png"}),
                        assistant("2")]}  # fmt: skip
    one = {"messages": [user({"type": "image", "image": "red.png"}), assistant("1")]}
    plain = {"messages": [{"role": "user", "content": "no image"}, assistant("0")]}
    write(tmp_path / "data.jsonl", [two, one, plain, one, two])
    windows = list(stream_of(tmp_path / "data.jsonl", tok, template, seq_len=400))
    counts = [int(w["num_images"]) for w in windows]
    assert counts == [3, 3], counts  # two + one fill the 3 slots, plain joins them; one + two: tokens fit all 5
    for w in windows:
        assert sum(t == 1000 for t in w["input_ids"].tolist()) == int(w["num_images"]) * 4  # 4 features each
        assert set(w) == {"input_ids", "labels", "position_ids", *IMAGE_KEYS}
        expected = process_image(Image.open(red), 112, 56).pixel_values[0]
        for i in range(int(w["num_images"])):
            torch.testing.assert_close(w["pixel_values"][i], expected, atol=0, rtol=0)
    trained = [[t for t in w["labels"].tolist() if t != IGNORE_INDEX] for w in windows]
    decoded = [tok.tokenizer.decode(t, skip_special_tokens=False) for t in trained]
    assert decoded == ["2<|endoftext|>1<|endoftext|>0<|endoftext|>", "1<|endoftext|>2<|endoftext|>"]
    batch = torch.utils.data.default_collate(windows)
    assert batch["pixel_values"].shape == (2, 3, 3, 112, 112) and batch["num_images"].tolist() == [3, 3]


def test_text_sources_and_overlong_records_keep_images_whole(tmp_path, tok, template):
    """A text window in a run with images carries the tensors empty; a record cut to the window is cut before
    the image run it would split, keeping the images before it."""
    draw(tmp_path / "a.png", (80, 80), (0, 200, 0))
    parts = [{"type": "image", "image": "a.png"}, text(" x" * 20), {"type": "image", "image": "a.png"}]
    write(tmp_path / "data.jsonl", [{"messages": [{"role": "system", "content": "s"}, user(*parts), assistant("y")]}])
    first_run = len(ids_of(tok, "<|system|>\ns\n<|user|>\n")) + 6  # the first image's 6 tokens
    seq_len = first_run + 10  # the second image's run starts past the window
    windows = list(stream_of(tmp_path / "data.jsonl", tok, template, seq_len=seq_len, train_on="all"))
    assert len(windows) == 1 and int(windows[0]["num_images"]) == 1
    ids = windows[0]["input_ids"].tolist()
    assert sum(t == 1000 for t in ids) == 4 and 1002 in ids  # one whole run, no piece of the second
    text_file = tmp_path / "text.jsonl"
    text_file.write_text(json.dumps({"text": "plain text " * 40}) + "\n")
    source = open_source(SourceSpec(path=str(text_file)), "text", "file", None, shuffle=False, seed=0, format="text")
    window = next(iter(TokenWindows([source], tok, 32, endless=False, template=template, images=OPTIONS)))
    assert int(window["num_images"]) == 0 and window["pixel_values"].shape == (3, 3, 112, 112)
    assert not window["pixel_values"].any() and (window["labels"] != IGNORE_INDEX).all()


def test_exact_resume_replays_the_same_windows_and_pixels(tmp_path, tok, template):
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    records = []
    for i, colour in enumerate(colours * 3):
        draw(tmp_path / f"{i}.png", (60 + 10 * i, 70), colour)
        records.append({"messages": [user({"type": "image", "image": f"{i}.png"}, text(f"q{i}")), assistant(f"a{i}")]})
    write(tmp_path / "data.jsonl", records)
    make = lambda: stream_of(tmp_path / "data.jsonl", tok, template, seq_len=64)  # noqa: E731
    reference = list(make())
    assert len(reference) >= 6
    for k in (1, 3, 5):
        stream = make()
        it = iter(stream)
        for _ in range(k):
            next(it)
        state = copy.deepcopy(stream.state_dict())
        resumed = make()
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert len(rest) == len(reference) - k
        for a, b in zip(rest, reference[k:]):
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


# ---------------------------------------------------------------------------------------------- refusals

BAD = {
    "http": ({"messages": [user({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}), assistant("a")]},
             "no network at training time"),
    "missing_file": ({"messages": [user({"type": "image", "image": "nope.png"}), assistant("a")]}, "no such file"),
    "more_images_than_slots": ({"messages": [{"role": "user", "content": "<image>"}, assistant("a")],
                                "images": ["ok.png", "ok.png"]}, "more images than placeholders"),
    "more_slots_than_images": ({"messages": [{"role": "user", "content": "<image> <image>"}, assistant("a")],
                                "images": ["ok.png"]}, "more image slots than images"),
    "image_token_in_text": ({"messages": [{"role": "user", "content": "see <im_patch>"}, assistant("a")]},
                            "one of Step-3.7's image tokens"),
    "truncated_png": ({"messages": [user({"type": "image", "image": "cut.png"}), assistant("a")]}, "truncated"),
    "too_many_for_a_window": ({"messages": [user(*[{"type": "image", "image": "ok.png"}] * 4), assistant("a")]},
                              "data.images.max_images = 3"),
    "too_many_crops": ({"messages": [user({"type": "image", "image": "big.png"}), assistant("a")]},
                       "121 crops; a window holds data.images.max_crops = 12"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_image_records_name_file_and_line(tmp_path, tok, template, case):
    record, said = BAD[case]
    draw(tmp_path / "ok.png", (50, 50), (0, 0, 0))
    whole = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    draw(tmp_path / "big.png", (600, 600), (0, 0, 0))  # 11 x 11 crops of 56 pixels
    good = {"messages": [user({"type": "image", "image": "ok.png"}), assistant("fine")]}
    path = write(tmp_path / "data.jsonl", [good, record, good])
    with pytest.raises(BadRecordError, match=rf"{path}:2: .*{said}"):
        list(stream_of(path, tok, template))
    with pytest.warns(UserWarning, match=rf"skipping bad record at {path}:2: .*{said}"):
        windows = list(stream_of(path, tok, template, seq_len=64, strict=False))
    assert sum(int(w["num_images"]) for w in windows) == 2  # the good ones train


def test_without_data_images_a_record_with_images_stops_the_run(tmp_path, tok, template):
    draw(tmp_path / "ok.png", (50, 50), (0, 0, 0))
    for record, said in [
        ({"messages": [user({"type": "image", "image": "ok.png"}), assistant("a")]}, "content part 0 is an image"),
        ({"messages": [{"role": "user", "content": "<image>"}, assistant("a")], "images": ["ok.png"]},
         "the record lists 'images'"),
    ]:  # fmt: skip
        path = write(tmp_path / "data.jsonl", [record])
        with pytest.raises(ImagesNotSupported, match=rf"{path}:1: .*{said}.*data\.images"):
            list(stream_of(path, tok, template, images=None))


def test_a_tokenizer_without_image_tokens_is_refused_at_setup(tmp_path, template):
    plain = TextTokenizer.from_folder(builtin_tokenizer_dir(300, tmp_path / "cache"))
    with pytest.raises(ValueError, match="has no token '<im_patch>'"):
        stream_of(write(tmp_path / "d.jsonl", [{"messages": [assistant("a")]}]), plain, template)


def test_image_options_are_checked():
    with pytest.raises(ValueError, match="data.images.view_size=100: must be a multiple of 56"):
        ImageOptions(view_size=100)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['size'\]"):
        ImageOptions.of({"size": 112})
    assert ImageOptions.of({}) == ImageOptions(728, 504, 4, 36)


def test_jsonl_data_url_pixels_equal_the_file(tmp_path, tok, template):
    """A data: URL and the path of the same file give the same pixels (io round trip through base64)."""
    path = draw(tmp_path / "p.png", (70, 90), (10, 200, 90))
    buffer = io.BytesIO(path.read_bytes())
    a = process_image(Image.open(buffer), 112, 56)
    records = [{"messages": [user({"type": "image_url", "image_url": {"url": data_url(path)}}), assistant("a")]}]
    window = next(iter(stream_of(write(tmp_path / "d.jsonl", records), tok, template)))
    torch.testing.assert_close(window["pixel_values"][0], a.pixel_values[0], atol=0, rtol=0)


def test_the_datamodule_batches_carry_the_pixels(tmp_path):
    """data.images through Step35DataModule: the built-in tokenizer gets the image tokens, batches stack the
    image tensors, and the image token id is the tokenizer's `<im_patch>`."""
    from step35.data import Step35DataModule

    draw(tmp_path / "a.png", (100, 60), (0, 90, 200))
    records = [{"messages": [user({"type": "image", "image": "a.png"}, text(f"q{i}")), assistant(f"a{i}")]}
               for i in range(8)]  # fmt: skip
    write(tmp_path / "data.jsonl", records)
    dm = Step35DataModule(
        files=str(tmp_path / "data.jsonl"), format="chat", seq_len=48, micro_batch_size=2, val_batches=0,
        cache_dir=str(tmp_path / "cache"), builtin_vocab_size=1000, images={"view_size": 112, "crop_size": 56},
    )  # fmt: skip
    dm.setup()
    assert dm.image_token_id == 1000 and dm.hparams["images"]["view_size"] == 112
    batch = next(iter(dm.train_dataloader()))
    assert batch["pixel_values"].shape == (2, 4, 3, 112, 112)
    assert batch["pixel_values_local"].shape == (2, 36, 3, 56, 56) and batch["num_images"].min() >= 1
    features = process_image(Image.open(tmp_path / "a.png"), 112, 56).image_token_count  # 2 crops + the view: 6
    assert features == 6
    assert all((row == 1000).sum() == features * n for row, n in zip(batch["input_ids"], batch["num_images"]))
