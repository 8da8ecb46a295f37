"""An image conversation set that needs no download: solid shapes in solid colours, drawn with Pillow, and
questions that only the image answers (`data.builtin: images`, configs/tiny-vision.yaml).

Each image is a 112 x 112 PNG: one shape (circle, square, triangle) in one of six colours on a light grey
ground, at a size and place drawn from the image's seed. Each conversation asks one question about its image, in
one of three forms, all of whose answers are the image's:

  * "What colour is the shape?" -> "red."
  * "What shape is this?" -> "a circle."
  * "Describe the image." -> "a red circle."

The text alone cannot tell the answer (every colour and shape is equally likely behind every question), so a model
that learns them reads the image: the loss on the answer tokens falls below what any text-only model reaches
(`text_only_bound`, the entropy of the answers given the question), and greedy answers on images it never saw are
right. 18 colour-and-shape pairs x 21 drawings = 378 images, each with one question (each pair 7 times in each
form), shuffled (the data stream reads a file in its order: a batch then holds every colour and shape, not a run
of one), written once, atomically, under the cache as `images-v7/data.jsonl` with the PNGs beside it
(records name them by a path relative to the jsonl: `{"messages": [{"role": "user", "content": [{"type":
"text", "text": "..."}, {"type": "image", "image": "img/0.png"}]}, {"role": "assistant", "content": "..."}]}`;
every other record has the image before the question, where `step35 generate --image` puts it).
`image_conversations(n, seed)` draws other images (a held-out set) the same way.

112 pixels are the `tiny-vl` preset's view (8 x 8 patches of 14 pixels, 4 vision features): a square image no
larger than the view has no crops, so an image is 6 tokens (`<im_start>`, 4 x `<im_patch>`, `<im_end>`) and the
tiny model trains on hundreds of them a minute on two CPU cores.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from PIL import Image, ImageDraw

from step35.data.builtin import cache_root, write_folder_once

SIDE = 112  # pixels a side: the tiny-vl view, no crops
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (40, 70, 220),
    "yellow": (235, 215, 30),
    "purple": (140, 40, 170),
    "orange": (245, 140, 20),
}
SHAPES = ("circle", "square", "triangle")
GROUND = (225, 225, 225)
QUESTIONS = {
    "colour": ("What colour is the shape?", "{colour}."),
    "shape": ("What shape is this?", "a {shape}."),
    "both": ("Describe the image.", "a {colour} {shape}."),
}
DRAWINGS = 21  # per colour-and-shape pair in the built-in set
VERSION = "images-v7"


def draw_shape(colour: str, shape: str, rng: random.Random) -> Image.Image:
    """One image: `shape` in `colour`, its size (5/8 to 11/16 of the side) and its place (within 4 pixels of the
    centre) from `rng`."""
    image = Image.new("RGB", (SIDE, SIDE), GROUND)
    size = rng.randint(5 * SIDE // 8, 11 * SIDE // 16)
    x, y = (SIDE - size) // 2 + rng.randint(-4, 4), (SIDE - size) // 2 + rng.randint(-4, 4)  # near the centre
    fill = COLOURS[colour]
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse([x, y, x + size, y + size], fill=fill)
    elif shape == "square":
        draw.rectangle([x, y, x + size, y + size], fill=fill)
    else:
        height = round(size * math.sqrt(3) / 2)
        draw.polygon([(x, y + height), (x + size, y + height), (x + size // 2, y)], fill=fill)
    return image


def image_conversations(count: int, seed: int) -> list[tuple[Image.Image, str, str, dict]]:
    """`count` (image, question, answer, {colour, shape, form}) drawn from `seed`: the question forms cycle, and
    the colour-and-shape pairs every three records, so that with a multiple of 54 records every pair is asked in
    every form equally often (the built-in 378: each pair 7 times in each form)."""
    rng = random.Random(seed)
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    forms = list(QUESTIONS)
    out = []
    for i in range(count):
        colour, shape = pairs[(i // len(forms)) % len(pairs)]
        form = forms[i % len(forms)]
        question, answer = QUESTIONS[form]
        out.append((draw_shape(colour, shape, rng), question, answer.format(colour=colour, shape=shape),
                    {"colour": colour, "shape": shape, "form": form}))  # fmt: skip
    return out


def record_of(image_path: str, question: str, answer: str, image_first: bool) -> dict:
    """The chat record of one image conversation: the image part before the question (as `step35 generate
    --image` places it), or after it (right before the reply, a few tokens from where the answer is predicted: a
    model learning from scratch finds it sooner)."""
    question_part, image_part = {"type": "text", "text": question}, {"type": "image", "image": image_path}
    content = [image_part, question_part] if image_first else [question_part, image_part]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


def write_image_set(folder: Path, conversations: list) -> Path:
    """The conversations as `folder/data.jsonl` with their PNGs in `folder/img/`; the jsonl's path."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (image, question, answer, _) in enumerate(conversations):
        image.save(folder / "img" / f"{i}.png")
        lines.append(json.dumps(record_of(f"img/{i}.png", question, answer, image_first=i % 2 == 1)) + "\n")
    (folder / "data.jsonl").write_text("".join(lines))
    return folder / "data.jsonl"


def builtin_images_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in image conversations' jsonl, written once (a folder made aside, then renamed into place)."""
    folder = cache_root(cache_dir) / VERSION
    if not (folder / "data.jsonl").is_file():
        conversations = image_conversations(len(COLOURS) * len(SHAPES) * DRAWINGS, seed=0)
        random.Random(0).shuffle(conversations)  # the stream reads a file in order: mixed batches, not runs of red
        write_folder_once(folder, "data.jsonl", lambda staging: write_image_set(staging, conversations))
    return folder / "data.jsonl"


def text_only_bound(answers_by_question: dict[str, list[list[int]]]) -> float:
    """The lowest mean loss per answer token any model that does not see the images can reach on answers drawn as
    these are: for each question, -log of the empirical probability of each answer's tokens, summed over the
    answers and divided by their tokens (the chain rule: the per-token losses of a prefix-conditional predictor sum
    to -log p(answer | question))."""
    total, tokens = 0.0, 0
    for answers in answers_by_question.values():
        counts: dict[tuple[int, ...], int] = {}
        for ids in answers:
            counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        for ids in answers:
            total -= math.log(counts[tuple(ids)] / len(answers))
            tokens += len(ids)
    return total / tokens
