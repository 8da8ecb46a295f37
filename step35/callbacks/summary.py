"""The model summary at the start of fit, without a FLOPs column.

Lightning's summary counts FLOPs by running the module's `example_input_array`; step35's module has
none (a forward at start-up would cost a training step's time on a large model), so the column and its
total read 0. step35 reports compute where it is measured: SpeedMonitor's TFLOP/s and MFU from the
FLOPs formula of docs/architecture.md §5. The CLI installs this summary unless a model summary is
configured or `trainer.enable_model_summary` is false.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import get_human_readable_count

DROPPED_COLUMNS = ("FLOPs",)


class Step35ModelSummary(ModelSummary):
    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        """Prints the per-module table (name, type, parameters, mode, ...) and one line of totals."""
        print(
            format_summary(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes),
            flush=True,
        )


def format_summary(
    summary_data: list[tuple[str, list[str]]],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
) -> str:
    columns = [(name, [str(v) for v in values]) for name, values in summary_data if name not in DROPPED_COLUMNS]
    widths = [max([len(name), *map(len, values)]) for name, values in columns]
    lines = [" | ".join(name.ljust(w) for (name, _), w in zip(columns, widths)).rstrip()]
    lines.append("-" * len(lines[0]))
    for row in zip(*(values for _, values in columns)):
        lines.append(" | ".join(value.ljust(w) for value, w in zip(row, widths)).rstrip())
    lines.append(
        f"{get_human_readable_count(total_parameters).strip()} parameters "
        f"({get_human_readable_count(trainable_parameters).strip()} trainable), {model_size:,.1f} MB; "
        f"modules in train mode: {total_training_modes.get('train', 0)}, "
        f"in eval mode: {total_training_modes.get('eval', 0)}"
    )
    return "\n".join(lines)
