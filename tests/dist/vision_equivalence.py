"""Step-3.7's vision side trained under FSDP2 + EP (and context parallelism) against one plain model, on gloo ranks.

  torchrun --standalone --nproc-per-node 2 tests/dist/vision_equivalence.py --out r.pt --case ep2="--ep 2 --cp 1"

Every rank builds the `tiny-vl` vision-language model twice from the same init: plain (the whole batch, one
process's computation) and parallelized. The batch holds 2 rows per data-parallel group; the images of the batch
contract (image_records.py: padded slots with counts) are packed per row. With cp 1 (2 data-parallel ranks), rank
0's micro-batch holds images and rank 1's none: rank 1 must still call every vision module (FSDP all-gathers and
reduce-scatters) or the job hangs. With cp 2 both ranks hold the same rows, images in them, and each takes its
share of the sequence after the features are spliced. Vision trained (`--train-vision`) or frozen; MTP on. Rank 0
writes both losses and every trained parameter's relative gradient error ||g - g_ref|| / ||g_ref||.
"""

import argparse

import torch
import torch.distributed as dist

from step35.checkpoint.hf.materialize import materialize
from step35.config import load_vision_config, preset
from step35.model import build_model
from step35.model.vision import images_of_batch
from step35.parallel import ParallelDims, parallelize
from step35.training.vision import freeze_vision
from tests.dist.cases import main

SEQ, ROWS, VIEW, CROP = 48, 2, 112, 56
IMAGE_TOKEN = 1000
FEATURES = {VIEW: 4, CROP: 1}  # vision features of a 112-pixel view and of a 56-pixel crop


def image_rows(rows_with_images: list[list[int]], g: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Token rows [R, SEQ + 1] whose image placeholders are where the images stand, and the padded batch tensors.
    rows_with_images[r]: the crops of each image of row r (0: none)."""
    R, slots, crop_slots = len(rows_with_images), 2, 6
    tokens = torch.randint(2, IMAGE_TOKEN, (R, SEQ + 1), generator=g)
    pixel_values = torch.zeros(R, slots, 3, VIEW, VIEW)
    pixel_values_local = torch.zeros(R, crop_slots, 3, CROP, CROP)
    num_local_patches = torch.zeros(R, slots, dtype=torch.long)
    num_images = torch.tensor([len(images) for images in rows_with_images])
    for r, images in enumerate(rows_with_images):
        at, first = 3, 0
        for i, crops in enumerate(images):
            count = crops * FEATURES[CROP] + FEATURES[VIEW]
            tokens[r, at : at + count] = IMAGE_TOKEN
            at += count + 5
            pixel_values[r, i] = torch.randn(3, VIEW, VIEW, generator=g)
            pixel_values_local[r, first : first + crops] = torch.randn(crops, 3, CROP, CROP, generator=g)
            num_local_patches[r, i] = crops
            first += crops
    return tokens, {"pixel_values": pixel_values, "pixel_values_local": pixel_values_local,
                    "num_local_patches": num_local_patches, "num_images": num_images}  # fmt: skip


def equal_counts(labels: torch.Tensor) -> torch.Tensor:
    """`labels` with the last targets of each row masked until every row has as many as the fewest: each
    data-parallel group's mean loss then averages to the whole batch's."""
    labels = labels.clone()
    fewest = int((labels != -100).sum(1).min())
    for row in labels:
        trained = (row != -100).nonzero().flatten()
        row[trained[fewest:]] = -100
    return labels


def rows_of(batch: dict, rows: slice) -> dict:
    return {key: value[rows] for key, value in batch.items()}


def full_grads(model) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def run(args: argparse.Namespace, distributed: bool) -> dict:
    assert distributed, "run under torchrun"
    rank, world = dist.get_rank(), dist.get_world_size()
    config, vision = preset("tiny-vl"), load_vision_config("tiny-vl")
    dp = world // args.cp
    g = torch.Generator().manual_seed(3)
    # data-parallel group 0: images (2 and 1, with crops); group 1: text only (when there are 2 groups)
    layout = [[3, 0], [1]] + [[], []] * (dp - 1) if args.cp == 1 else [[3, 0], [1]]
    tokens, images = image_rows(layout, g)
    labels = equal_counts(tokens[:, 1:].masked_fill(tokens[:, 1:] == IMAGE_TOKEN, -100))  # images: no target

    plain = build_model(config, vision=vision)
    materialize(plain, "cpu", seed=7)
    freeze_vision(plain, args.train_vision)
    ref = plain.loss(tokens[:, :-1], labels, mtp_loss_weight=0.3, images=images_of_batch(**images))
    ref.loss.backward()

    model = build_model(config, vision=vision)
    freeze_vision(model, args.train_vision)
    dims = ParallelDims(world, args.ep, num_experts=config.moe_num_experts, context_parallel_size=args.cp)
    parallelize(model, dims.build("cpu"))
    materialize(model, "cpu", seed=7)
    group = dims.data_parallel_rank(rank)
    rows = slice(group * ROWS, (group + 1) * ROWS)
    mine = images_of_batch(**rows_of(images, rows))
    out = model.loss(tokens[rows, :-1], labels[rows], mtp_loss_weight=0.3, images=mine)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    loss /= world  # the mean over data-parallel groups (every cp rank holds its group's loss)
    got, want = full_grads(model), full_grads(plain)
    errors = {
        name: ((got[name].double() - w.double()).norm() / w.double().norm().clamp(min=1e-12)).item()
        for name, w in want.items()
    }
    return {
        "loss": loss.item(), "ref_loss": ref.loss.item(), "grad_errors": errors, "missing": sorted(set(want) - set(got)),
        "images_on_rank": int(rows_of(images, rows)["num_images"].sum()),
        "vision_grads": sorted(n for n in want if n.startswith(("vision_model.", "vit_large_projector."))),
    }  # fmt: skip


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--train-vision", action="store_true")
    return p


if __name__ == "__main__":
    main(options(), run)
