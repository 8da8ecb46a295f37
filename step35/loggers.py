"""wandb for step35: offline unless an API key is configured, never writing the key anywhere."""

from __future__ import annotations

import netrc
import os
from pathlib import Path

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

    def __init__(self, project: str = "step35", name: str | None = None, save_dir: str = "runs",
                 offline: bool | None = None, log_model: bool = False, **kwargs):
        """
        Args:
            project: wandb project.
            name: run name (default: wandb's).
            save_dir: where the wandb run folder goes.
            offline: force offline (True) or online (False); None: online only if a key is configured.
            log_model: upload checkpoints as wandb artifacts.
        """
        if offline is None:
            offline = not wandb_key_configured()
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(project=project, name=name, save_dir=save_dir, offline=offline, log_model=log_model, **kwargs)
