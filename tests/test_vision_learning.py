"""The tiny Step-3.7 model learns what only the image tells: `step35 fit --config configs/tiny-vision.yaml` (the
built-in image conversations, from scratch), then, on images it never saw (another seed), the loss on the answer
tokens falls well below the lowest loss any text-only model can reach on them (builtin_images.text_only_bound: the
entropy of the held-out answers given their question) and below the same model's with the images shuffled among
the records, and `step35 generate --chat --image` answers right on >= 90 % of them (greedy)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from step35.data.builtin_images import image_conversations, text_only_bound, write_image_set
from step35.data.image_records import ImageOptions
from step35.data.packing import IGNORE_INDEX
from step35.data.spec import SourceSpec, open_source
from step35.data.stream import TokenWindows
from step35.training.objective import LanguageModelObjective
from tests.runner import cli, cli_fit

CONFIG = Path(__file__).parent.parent / "configs" / "tiny-vision.yaml"
HELD_OUT = 54  # 3 drawings of each colour-and-shape pair, each question form alike, from another seed


def answer_losses(generator, jsonl: Path, held_out: list) -> tuple[float, float, float]:
    """(held-out answer-token loss, the same with the images shuffled among the records, the text-only bound)."""
    template, tokenizer = generator.chat_template(), generator._text_tokenizer()
    source = open_source(SourceSpec(path=str(jsonl)), "text", "file", None, shuffle=False, seed=0, format="chat")
    options = ImageOptions(*generator.image_sizes, max_images=4, max_crops=4)
    windows = list(TokenWindows([source], tokenizer, 48, endless=False, strict=True, images=options,
                                template=template))  # fmt: skip
    assert sum(int(w["num_images"]) for w in windows) == len(windows) == len(held_out)  # one record a window
    batch = torch.utils.data.default_collate(windows)
    shuffled = {**batch, "pixel_values": batch["pixel_values"][torch.roll(torch.arange(len(windows)), 7)]}
    objective = LanguageModelObjective()
    with torch.no_grad():
        sums = [objective.micro_batch(generator.model, b, training=False).sums for b in (batch, shuffled)]
    answers: dict[str, list[list[int]]] = {}
    for window, (_, _, _, facts) in zip(windows, held_out):
        answers.setdefault(facts["form"], []).append([t for t in window["labels"].tolist() if t != IGNORE_INDEX])
    return sums[0][4].item() / sums[0][0].item(), sums[1][4].item() / sums[1][0].item(), text_only_bound(answers)


@pytest.mark.slow  # a training run of 2.5 minutes and 54 generations: -m slow (README, Tests)
@pytest.mark.timeout(1800)
def test_the_tiny_model_answers_about_images_it_never_saw(tmp_path, capfd):
    from step35.commands.generate import image_prompt
    from step35.eval.generator import load_generator

    started = time.monotonic()
    cli_fit(capfd, CONFIG, tmp_path / "run", tmp_path / "cache")
    trained_in = time.monotonic() - started
    held_out = image_conversations(HELD_OUT, seed=1)
    jsonl = write_image_set(tmp_path / "held_out", held_out)
    generator = load_generator(tmp_path / "run")
    assert generator.image_sizes == (112, 56)  # the run's data.images
    loss, shuffled, bound = answer_losses(generator, jsonl, held_out)

    template = generator.chat_template()
    replies = []
    for i, (_, question, _, _) in enumerate(held_out):
        content, images = image_prompt(generator, question, [str(tmp_path / "held_out" / "img" / f"{i}.png")])
        replies.append(
            generator.decode(generator.generate_ids(generator.chat_ids(template, content), 16, images=images))
        )
    right = sum(reply.strip() == answer for reply, (_, _, answer, _) in zip(replies, held_out))
    accuracy = right / HELD_OUT
    # the command itself, as users run it
    code, out, _ = cli(capfd, "generate", "--checkpoint", str(tmp_path / "run"), "--chat", "true", "--image",
                       str(tmp_path / "held_out" / "img" / "0.png"), "--prompt", held_out[0][1], "--max_new_tokens",
                       "16")  # fmt: skip
    print(
        f"trained in {trained_in:.0f} s; held-out answer-token loss {loss:.4f} (images shuffled {shuffled:.3f},"
        f" text-only bound {bound:.3f}); greedy answers right {right}/{HELD_OUT} = {accuracy:.0%};"
        f" generate --image on {held_out[0][2]!r}: {out.strip()!r}"
    )
    assert code == 0 and out.strip() == replies[0].strip(), (out, replies[0])  # the command answers as the loop
    assert loss < 0.5 * bound and loss < 0.5 * shuffled, (loss, shuffled, bound)
    assert accuracy >= 0.9, accuracy


def test_the_builtin_image_set_is_balanced_and_its_images_tell_the_answer(tmp_path):
    """378 records, written once: every colour-and-shape pair asked in every question form 7 times, the image
    before the question in half of them, and each PNG's shape pixels in the colour its answer names."""
    import collections
    import json

    from PIL import Image

    from step35.data.builtin_images import COLOURS, GROUND, builtin_images_path

    path = builtin_images_path(tmp_path)
    assert builtin_images_path(tmp_path) == path  # the second call reads what the first wrote
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 378
    asked = collections.Counter()
    for record in records:
        content = record["messages"][0]["content"]
        question = next(p["text"] for p in content if p["type"] == "text")
        answer = record["messages"][1]["content"].rstrip(".").split()
        asked[question, " ".join(a for a in answer if a != "a")] += 1
    assert len(asked) == 6 + 3 + 18 and set(asked.values()) == {7 * 3, 7 * 6, 7}, asked
    assert sum(r["messages"][0]["content"][0]["type"] == "image" for r in records) == 189
    for record in records[:36]:
        image_part = next(p for p in record["messages"][0]["content"] if p["type"] == "image")
        pixels = collections.Counter(Image.open(path.parent / image_part["image"]).convert("RGB").getdata())
        shape_colour = next(c for c, _ in pixels.most_common() if c != GROUND)
        named = [name for name in COLOURS if name in record["messages"][1]["content"]]
        assert not named or COLOURS[named[0]] == shape_colour, (record, shape_colour)


def test_text_only_bound_is_the_answers_entropy_per_token():
    """Six equally likely one-token answers then a shared end token: ln 6 over two tokens per answer."""
    import math

    answers = {"colour": [[c, 9] for c in range(6)] * 5}
    assert text_only_bound(answers) == pytest.approx(math.log(6) / 2, rel=1e-12)
    assert text_only_bound({"q": [[1, 2]] * 4}) == 0.0


def test_builtin_images_needs_data_images():
    from step35.data.datamodule import Step35DataModule

    with pytest.raises(ValueError, match="data.builtin: images needs data.images"):
        Step35DataModule(format="chat", builtin="images")
