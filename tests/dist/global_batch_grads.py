"""One optimizer step of the tiny model on eight sequences with masked labels of very different
trained lengths (one row fully masked, two rows packed with several documents), MTP and the aux
balance loss on, split as --batch sequences x --accum micro-batches per rank; rank 0 writes the
step's gradients (as the optimizer would see them, full tensors), its logged losses and its trained
tokens to --out. Run in one process or under torchrun (gloo, Step35Strategy: FSDP2, EP over 2 ranks); a
test calls one_step in its own process for the one-process splits.

  python tests/dist/global_batch_grads.py --out one.pt --batch 8 --accum 1
  torchrun --standalone --nproc-per-node 2 tests/dist/global_batch_grads.py --out ranks.pt --batch 2 --accum 2
"""

import argparse
import os

import torch

from step35.model import IGNORE_INDEX
from step35.module import Step35LightningModule
from step35.strategy import Step35Strategy
from tests.helpers import make_trainer

ROWS, SEQ = 8, 24
# Trained label spans per row ([start, end) of labels); rows 3 and 6 hold packed documents.
SPANS = [[(0, 24)], [], [(5, 8)], [(2, 11), (13, 24)], [(1, 4), (10, 14)], [(23, 24)], [(0, 11), (12, 13)],
         [(4, 20)]]
DOCUMENT_STARTS = {3: [12], 6: [7, 12]}  # positions where a new document starts (besides 0)


def batches() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1024, (ROWS, SEQ + 1), generator=g)
    rows = []
    for i in range(ROWS):
        labels = torch.full((SEQ,), IGNORE_INDEX)
        for start, end in SPANS[i]:
            labels[start:end] = ids[i, start + 1:end + 1]
        positions = torch.arange(SEQ)
        for start in DOCUMENT_STARTS.get(i, []):
            positions[start:] = torch.arange(SEQ - start)
            labels[start - 1] = IGNORE_INDEX  # the border: no label crosses into the next document
        rows.append({"input_ids": ids[i], "labels": labels, "position_ids": positions})
    return rows


class CaptureGrads(Step35LightningModule):
    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.grads = {}
        for name, p in self.named_parameters():
            if p.grad is not None:
                g = p.grad
                self.grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def one_step(batch: int, accumulate: int) -> dict | None:
    """One optimizer step split as `batch` sequences x `accumulate` micro-batches on each of this job's ranks (one
    process when not under torchrun): on rank 0 the gradients, logged losses and trained tokens; None elsewhere."""
    torch.manual_seed(0)  # the same global generator in every process (the init itself is seeded)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = batches()
    loader = torch.utils.data.DataLoader(data, batch_size=batch)  # sharded over ranks by Lightning
    module = CaptureGrads(config="tiny", warmup_steps=1, mtp_loss_weight=0.3, moe_aux_loss_coef=0.01, init_seed=3)
    trainer = make_trainer(devices=world, strategy=Step35Strategy(expert_parallel_size=world), max_steps=1,
                           accumulate_grad_batches=accumulate, enable_checkpointing=False)
    trainer.fit(module, train_dataloaders=loader)
    if trainer.global_rank != 0:
        return None
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    return {"grads": module.grads, "loss": metrics["train/loss"], "lm_loss": metrics["train/lm_loss"],
            "mtp1_loss": metrics["train/mtp1_loss"], "trained": int(metrics["train/trained_tokens"]),
            "trained_per_row": [int((row["labels"] != IGNORE_INDEX).sum()) for row in data]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    args = p.parse_args()
    result = one_step(args.batch, args.accum)
    if result is not None:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
