"""The observability callbacks in-process (tiny model, CPU, a few steps): expert counts against a
direct recount with route(), under gradient accumulation, validation and activation checkpointing;
MFU against a hand computation; memory metrics; the out-of-memory summary; metrics in the CSV
logger and in an offline wandb run read back from its .wandb file."""

import csv
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from step35.balancing import ExpertCounter
from step35.callbacks import ExpertLoadMonitor, MemoryMonitor, SpeedMonitor
from step35.callbacks.expert_load import load_stats
from step35.callbacks.memory import device_memory_stats
from step35.callbacks.throughput import peak_tflops_for
from step35.config import preset
from step35.flops import training_flops_per_token
from step35.model.moe import moe_layers
from step35.module import Step35LightningModule
from step35.parallel.parallelize import apply_activation_checkpointing
from tests.helpers import make_trainer, tensorboard_events, wandb_records

TOP_K = preset("tiny").moe_top_k  # 2
NUM_EXPERTS = preset("tiny").moe_num_experts  # 8


class RandomWindows(torch.utils.data.Dataset):
    """Token windows {"input_ids": [S + 1]} like the step35 data, from a fixed seed."""

    def __init__(self, n: int, seq_len: int, seed: int = 0, vocab: int = 1024):
        self.ids = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def loader(batch: int, seq_len: int, n: int = 64, seed: int = 0) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(RandomWindows(n, seq_len, seed), batch_size=batch)


def fit(module: pl.LightningModule, callbacks: list, max_steps: int, val=None, train=None, **kw) -> pl.Trainer:
    args = dict(
        max_steps=max_steps,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0 if val is None else 2,
        log_every_n_steps=1,
    )
    trainer = make_trainer(callbacks=callbacks, **(args | kw))
    trainer.fit(module, train_dataloaders=train or loader(2, 16), val_dataloaders=val)
    return trainer


class Recount(pl.Callback):
    """Independent count: route() called directly on each MoE layer's input, per optimizer step
    (the step being trained = trainer.global_step during its forwards); eval calls are tallied apart."""

    def __init__(self):
        self.per_step: dict[int, torch.Tensor] = {}
        self.train_calls = self.eval_calls = 0

    def on_train_start(self, trainer, pl_module):
        layers = [moe for _, moe in moe_layers(pl_module.model)]

        def hook(moe, args):
            if not moe.training:
                self.eval_calls += 1
                return
            self.train_calls += 1
            x = args[0]
            with torch.no_grad():
                _, ids, _ = moe.route(x.reshape(-1, x.shape[-1]))
            row = torch.bincount(ids.flatten(), minlength=moe.num_experts)
            step = self.per_step.setdefault(
                trainer.global_step, torch.zeros(len(layers), moe.num_experts, dtype=torch.int64)
            )
            step[layers.index(moe)] += row

        for moe in layers:
            moe.register_forward_pre_hook(hook)


class CaptureWindows(pl.Callback):
    """After ExpertLoadMonitor (later in the callback list): its window at every step where it popped one."""

    def __init__(self, monitor: ExpertLoadMonitor):
        self.monitor, self.windows = monitor, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor.last_counts is not None and trainer.global_step not in self.windows:
            if trainer.global_step % self.monitor.every_n_steps == 0:
                self.windows[trainer.global_step] = self.monitor.last_counts.clone()


def test_expert_counts_match_recount_with_accumulation_and_validation():
    monitor = ExpertLoadMonitor(every_n_steps=1, heatmap_every_n_steps=0)
    recount, capture = Recount(), CaptureWindows(monitor)
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    B, S, accum = 2, 16, 2
    trainer = fit(
        module,
        [recount, monitor, capture],
        max_steps=3,
        accumulate_grad_batches=accum,
        val=loader(2, 16, n=8, seed=1),
        val_check_interval=2,
    )
    assert recount.eval_calls > 0, "validation ran through the MoE layers"
    assert "val/loss" in trainer.callback_metrics
    assert sorted(capture.windows) == [1, 2, 3]
    for step, window in capture.windows.items():
        # every micro-batch of the step counted once, each token K times per MoE layer, eval not at all
        assert window.shape == (4, NUM_EXPERTS)
        assert window.sum(1).tolist() == [accum * B * S * TOP_K] * 4
        assert torch.equal(window, recount.per_step[step - 1]), step


class CheckpointedModule(Step35LightningModule):
    def configure_model(self):
        super().configure_model()
        for layer in self.model.model.layers:
            apply_activation_checkpointing(layer, "full")


def test_activation_checkpointing_does_not_double_count():
    runs = {}
    for name, cls in (("plain", Step35LightningModule), ("ac", CheckpointedModule)):
        monitor = ExpertLoadMonitor(every_n_steps=2, heatmap_every_n_steps=0)
        recount, capture = Recount(), CaptureWindows(monitor)
        module = cls(config="tiny", lr=0.0, warmup_steps=1)  # lr 0: both runs route identically
        fit(module, [recount, monitor, capture], max_steps=2)
        runs[name] = (capture.windows[2], recount.train_calls)
    (plain, plain_calls), (ac, ac_calls) = runs["plain"], runs["ac"]
    assert ac_calls == 2 * plain_calls, "the checkpointed forward was replayed in backward"
    assert torch.equal(ac, plain)
    assert ac.sum(1).tolist() == [2 * 2 * 16 * TOP_K] * 4


def test_expert_counter_windows_and_dropped_steps():
    from step35.model import Step35ForCausalLM

    model = Step35ForCausalLM(preset("tiny"))
    model.init_weights(0)
    counter = ExpertCounter(model)
    x = torch.randint(0, 1024, (2, 9))
    for keep in (True, False, True):
        model.loss(x[:, :-1], x[:, 1:])  # training mode: counted
        counter.end_step(keep=keep)
    model.eval()
    model.loss(x[:, :-1], x[:, 1:])  # eval: not counted
    window = counter.pop_window()
    assert window.sum(1).tolist() == [2 * 2 * 8 * TOP_K] * 4  # two kept steps
    assert counter.pop_window().sum() == 0  # a new, empty window
    assert all(int(moe.tokens_per_expert.sum()) == 0 for _, moe in moe_layers(model))  # buffers were reset


def test_load_stats_by_hand():
    s = load_stats(torch.tensor([6, 2, 0, 0]))  # mean 2
    assert s["max_over_mean"] == 3.0 and s["min_over_mean"] == 0.0 and s["dead"] == 2 and s["routed"] == 8
    assert s["cv"] == pytest.approx((((6 - 2) ** 2 + 0 + 4 + 4) / 4) ** 0.5 / 2)
    p = torch.tensor([0.75, 0.25])
    assert s["entropy"] == pytest.approx(float(-(p * p.log()).sum() / torch.log(torch.tensor(4.0))))
    assert load_stats(torch.tensor([5, 5, 5, 5])) == pytest.approx(
        {"max_over_mean": 1, "min_over_mean": 1, "cv": 0, "dead": 0, "entropy": 1, "routed": 20}
    )


class FakeTime(pl.Callback):
    """Each micro-batch takes `seconds` on a fake clock (listed before SpeedMonitor)."""

    def __init__(self, seconds: float):
        self.now, self.seconds = 1000.0, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.now += self.seconds


def test_mfu_equals_hand_computation(tmp_path):
    clock = FakeTime(seconds=0.5)
    monitor = SpeedMonitor(every_n_steps=2, peak_tflops=0.002)
    monitor.clock = lambda: clock.now
    module = Step35LightningModule(config="tiny", mtp_loss_weight=0.3, warmup_steps=1)  # MTP layer counted
    B, S, accum = 2, 16, 2
    trainer = fit(
        module, [clock, monitor], max_steps=4, accumulate_grad_batches=accum, logger=CSVLogger(tmp_path, name="csv")
    )
    # Hand computation: a step is 2 micro-batches x 0.5 s = 1.0 s and trains B*S*accum = 64 tokens.
    step_time = 2 * 0.5
    tokens_per_step = B * S * accum
    flops_per_token = training_flops_per_token(preset("tiny"), S, num_mtp_layers=1)
    expected_tflops = flops_per_token * tokens_per_step / step_time / 1e12
    expected_mfu = expected_tflops / 0.002
    rows = metric_rows(tmp_path / "csv" / "version_0")
    logged = [r for r in rows if r.get("throughput/mfu")]
    assert [int(r["step"]) for r in logged] == [1, 3]  # windows end at optimizer steps 2 and 4
    for r in logged:
        assert float(r["throughput/step_time_s"]) == pytest.approx(step_time)
        assert float(r["throughput/tokens_per_s"]) == pytest.approx(tokens_per_step / step_time)
        assert float(r["throughput/tokens_per_s_per_device"]) == pytest.approx(tokens_per_step / step_time)
        assert float(r["throughput/tflops_per_device"]) == pytest.approx(expected_tflops)
        assert float(r["throughput/mfu"]) == pytest.approx(expected_mfu)
    assert flops_per_token == pytest.approx(7.4774e6, rel=1e-4)  # tiny, S=16, + 1 MTP layer: ~6 x 1.2 M params
    assert {"tok/s", "mfu", "train/loss"} <= set(trainer.progress_bar_metrics)


def test_peak_table_and_no_mfu_on_cpu(tmp_path):
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_for("NVIDIA H200") == 989.0
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_for("Ascend910B2") == 320.0
    assert peak_tflops_for("cpu") is None
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    fit(module, [SpeedMonitor(every_n_steps=1)], max_steps=2, logger=CSVLogger(tmp_path, name="csv"))
    header = set(metric_rows(tmp_path / "csv" / "version_0")[0])
    assert "throughput/tflops_per_device" in header and "throughput/mfu" not in header


def metric_rows(folder: Path) -> list[dict]:
    with open(folder / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_memory_metrics_are_positive(tmp_path):
    stats = device_memory_stats(torch.device("cpu"))
    assert stats["allocated"] > 0 and stats["peak"] >= stats["allocated"]
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    trainer = fit(module, [MemoryMonitor(every_n_steps=1)], max_steps=2, logger=CSVLogger(tmp_path, name="csv"))
    rows = [r for r in metric_rows(tmp_path / "csv" / "version_0") if r.get("memory/peak_gib_max")]
    assert [int(r["step"]) for r in rows] == [0, 1]
    for r in rows:
        for key in ("allocated_gib", "reserved_gib", "peak_gib", "host_rss_gib"):
            assert float(r[f"memory/{key}_min"]) > 0
            assert float(r[f"memory/{key}_max"]) >= float(r[f"memory/{key}_min"])
        assert float(r["memory/alloc_retries_max"]) == 0
    assert trainer.progress_bar_metrics["mem_peak_gib"] > 0


class FailsAtStep(Step35LightningModule):
    def __init__(self, error: BaseException, **kw):
        super().__init__(**kw)
        self.error = error

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 1:
            raise self.error
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("NPU out of memory. Tried to allocate 1.00 GiB"),
    ],
)
def test_out_of_memory_prints_a_summary_and_propagates(error, capsys):
    module = FailsAtStep(error, config="tiny", warmup_steps=1)
    with pytest.raises(type(error), match="out of memory"):
        fit(module, [MemoryMonitor(every_n_steps=1)], max_steps=3)
    err = capsys.readouterr().err
    assert "[rank 0] out of memory on cpu at step 1" in err
    assert "process RSS" in err and "available" in err


def test_other_errors_print_no_memory_summary(capsys):
    module = FailsAtStep(ValueError("boom"), config="tiny", warmup_steps=1)
    with pytest.raises(ValueError, match="boom"):
        fit(module, [MemoryMonitor(every_n_steps=1)], max_steps=3)
    assert "out of memory" not in capsys.readouterr().err


# ------------------------------------------------------------------------------- loggers
def wandb_history(run_root: Path) -> list[dict]:
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in wandb_records(run_root, "history")
    ]


@pytest.mark.heavy  # 10 s or more (a run with wandb offline)
def test_metrics_reach_csv_and_offline_wandb(tmp_path):
    from step35.loggers import Step35WandbLogger

    csv_logger = CSVLogger(tmp_path, name="csv")
    wandb_logger = Step35WandbLogger(project="step35-test", save_dir=str(tmp_path / "wandb"), offline=True)
    callbacks = [
        SpeedMonitor(every_n_steps=2),
        MemoryMonitor(every_n_steps=2),
        ExpertLoadMonitor(every_n_steps=2, heatmap_every_n_steps=2),
    ]
    module = Step35LightningModule(config="tiny", warmup_steps=1, moe_bias_update_rate=0.01, moe_aux_loss_coef=0.01)
    try:
        fit(module, callbacks, max_steps=4, logger=[csv_logger, wandb_logger])
    finally:
        wandb_logger.experiment.finish()
    wanted = {
        "throughput/tokens_per_s",
        "throughput/tflops_per_device",
        "memory/peak_gib_max",
        "memory/host_rss_gib_min",
        "expert_load/cv",
        "expert_load/layer1/max_over_mean",
        "expert_load/dead",
        "router_bias/layer1/std",
        "train/loss",
        "train/aux_loss",
    }
    rows = metric_rows(tmp_path / "csv" / "version_0")
    assert wanted <= set(rows[0])
    history = wandb_history(tmp_path / "wandb")
    keys = set().union(*history)
    assert wanted <= keys, wanted - keys
    assert any(k.startswith("expert_load/heatmap") for k in keys)  # the image
    assert "router_bias/layer1/hist/_type" in keys  # the histogram
    heatmaps = sorted((tmp_path / "csv" / "version_0" / "expert_load").glob("heatmap_step*.png"))
    assert [p.name for p in heatmaps] == ["heatmap_step0000002.png", "heatmap_step0000004.png"]
    assert heatmaps[0].read_bytes()[:4] == b"\x89PNG"
    # the counts CSV next to each heatmap holds the window's totals: 2 steps x 2 x 16 tokens x K per layer
    with open(heatmaps[0].with_name("counts_step0000002.csv")) as f:
        counts = [list(map(int, r[1:])) for r in list(csv.reader(f))[1:]]
    assert [sum(r) for r in counts] == [2 * 2 * 16 * TOP_K] * 4
    # the router bias moved (rate > 0) and its stats were logged
    assert any(float(r["router_bias/layer1/std"]) > 0 for r in rows if r.get("router_bias/layer1/std"))


# ------------------------------------------------------------------------------- short runs, names
def heatmap_totals(csv_path: Path) -> list[int]:
    with open(csv_path) as f:
        return [sum(map(int, r[1:])) for r in list(csv.reader(f))[1:]]


def test_run_ending_between_heatmaps_gets_one_of_its_last_steps(tmp_path):
    # max_steps 5, windows of 2, heatmaps every 10: windows end at 2 and 4; the heatmap at the end
    # shows step 5 alone (1 step x 2 sequences x 16 tokens x K per layer).
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    fit(
        module,
        [ExpertLoadMonitor(every_n_steps=2, heatmap_every_n_steps=10)],
        max_steps=5,
        logger=CSVLogger(tmp_path, name="csv"),
    )
    folder = tmp_path / "csv" / "version_0" / "expert_load"
    assert sorted(p.name for p in folder.glob("heatmap_step*.png")) == ["heatmap_step0000005.png"]
    assert heatmap_totals(folder / "counts_step0000005.csv") == [1 * 2 * 16 * TOP_K] * 4
    # ending on a window boundary: the heatmap shows that last window (steps 3-4)
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    fit(
        module,
        [ExpertLoadMonitor(every_n_steps=2, heatmap_every_n_steps=10)],
        max_steps=4,
        logger=CSVLogger(tmp_path / "b", name="csv"),
    )
    folder = tmp_path / "b" / "csv" / "version_0" / "expert_load"
    assert sorted(p.name for p in folder.glob("heatmap_step*.png")) == ["heatmap_step0000004.png"]
    assert heatmap_totals(folder / "counts_step0000004.csv") == [2 * 2 * 16 * TOP_K] * 4


def test_tensorboard_logger_gets_metrics_heatmap_and_histogram(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    module = Step35LightningModule(config="tiny", warmup_steps=1, moe_bias_update_rate=0.01)
    fit(
        module,
        [SpeedMonitor(every_n_steps=2), ExpertLoadMonitor(every_n_steps=2, heatmap_every_n_steps=2)],
        max_steps=2,
        logger=TensorBoardLogger(tmp_path, name="tb"),
    )
    values = [(e.step, v) for e in tensorboard_events(tmp_path / "tb") for v in e.summary.value]
    tags = {v.tag for _, v in values}
    assert {"train/loss", "expert_load/cv", "throughput/tokens_per_s", "router_bias/layer1/std"} <= tags, tags
    images = [(step, v.image) for step, v in values if v.tag == "expert_load/heatmap"]
    assert len(images) == 1 and images[0][1].encoded_image_string[:4] == b"\x89PNG"
    assert images[0][1].height > 50 and images[0][1].width > 50
    hist = [v.histo for _, v in values if v.tag == "router_bias/layer1/hist"]
    assert len(hist) == 1 and hist[0].num == NUM_EXPERTS


class Linear(pl.LightningModule):
    """A one-layer model: the loop's behaviour is under test, not the model's."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w - batch["input_ids"].float().mean() / 1000).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", (self.w - 1).pow(2).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Validations(pl.Callback):
    def __init__(self):
        self.steps: list[int] = []

    def on_validation_end(self, trainer, pl_module):
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize(
    "max_steps,interval,final,expected",
    [
        (5, 100, True, [5]),  # the interval is beyond the run: one validation, at the end
        (5, 100, False, []),  # what Lightning alone does
        (5, 2, True, [2, 4, 5]),  # the run ends between two validations
        (4, 2, True, [2, 4]),  # the last step is a validation step: validated once
    ],
)
def test_final_validation(max_steps, interval, final, expected):
    from step35.callbacks import FinalValidation

    seen = Validations()
    callbacks = [seen] + ([FinalValidation()] if final else [])
    trainer = fit(
        Linear(),
        callbacks,
        max_steps=max_steps,
        val=loader(2, 16, n=4, seed=1),
        val_check_interval=interval,
        check_val_every_n_epoch=None,
    )
    assert seen.steps == expected
    assert trainer.global_step == max_steps  # the stop it requests ends nothing early


def test_speed_monitor_is_not_named_like_lightnings_callback():
    import step35.callbacks

    assert not hasattr(step35.callbacks, "ThroughputMonitor")  # Lightning's ThroughputMonitor means that one only
    root = Path(__file__).parent.parent
    named = set()
    for path in sorted((root / "configs").glob("*.yaml")):
        named |= {
            line.split("step35.callbacks.")[1].split()[0]
            for line in path.read_text().splitlines()
            if "class_path: step35.callbacks." in line
        }
    assert named >= {"SpeedMonitor", "ExpertLoadMonitor", "FinalValidation"}
    assert all(hasattr(step35.callbacks, name) for name in named), named
