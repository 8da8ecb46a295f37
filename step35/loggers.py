"""Loggers of step35. Both write into the run folder unless given a save_dir (the CLI fills it in):
wandb offline unless an API key is configured (never writing the key anywhere), and CSV."""

from __future__ import annotations

import netrc
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger


def wandb_key_configured() -> bool:
    """True when wandb could authenticate: WANDB_API_KEY, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        hosts = netrc.netrc(path).hosts
    except (FileNotFoundError, netrc.NetrcParseError, PermissionError):
        return False
    return any("wandb" in host for host in hosts)


class Step35WandbLogger(WandbLogger):
    """WandbLogger that runs offline when no API key is configured (sync later with `wandb sync`)."""

    def __init__(
        self,
        project: str = "step35",
        name: str | None = None,
        save_dir: str | None = None,
        offline: bool | None = None,
        log_model: bool = False,
        **kwargs,
    ):
        """
        Args:
            project: wandb project.
            name: run name (default: wandb's).
            save_dir: where the wandb run folder goes (default: the run folder under the CLI, else `runs`).
            offline: force offline (True) or online (False); None: online only if a key is configured.
            log_model: upload checkpoints as wandb artifacts.
        """
        if offline is None:
            offline = not wandb_key_configured()
        save_dir = save_dir or "runs"
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(project=project, name=name, save_dir=save_dir, offline=offline, log_model=log_model, **kwargs)


class CSVLogger(LightningCSVLogger):
    """Lightning's CSVLogger with an optional save_dir: `<save_dir>/<name>/version_N/metrics.csv`, one
    version folder per attempt of a run."""

    def __init__(
        self,
        save_dir: str | None = None,
        name: str = "csv",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ):
        """
        Args:
            save_dir: parent folder (default: the run folder under the CLI, else `runs`).
            name: sub-folder of save_dir.
            version: version folder (default: the next free version_N).
            prefix: prefix of every metric name.
            flush_logs_every_n_steps: rows buffered before they are written.
        """
        super().__init__(
            save_dir or "runs",
            name=name,
            version=version,
            prefix=prefix,
            flush_logs_every_n_steps=flush_logs_every_n_steps,
        )


class SampleTables:
    """Sampled completions with their rewards (online RL), written by rank 0: `<folder>/step=N.jsonl` and a wandb
    table `rl/samples` when a wandb logger is attached. A step's first call in this process writes its file anew
    (a step done again after a resume replaces the interrupted attempt's rows), later calls of the step add to it."""

    def __init__(self, folder: Path, trainer) -> None:
        self.folder, self.trainer = folder, trainer
        self.started: set[int] = set()

    def __call__(self, step: int, rows: list[dict]) -> None:
        import json

        self.folder.mkdir(parents=True, exist_ok=True)
        mode = "a" if step in self.started else "w"
        self.started.add(step)
        with open(self.folder / f"step={step}.jsonl", mode, encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger) and rows:
                columns = list(rows[0])
                data = [[json.dumps(r[c]) if isinstance(r[c], (list, dict)) else r[c] for c in columns] for r in rows]
                logger.log_table("rl/samples", columns=columns, data=data, step=step)
