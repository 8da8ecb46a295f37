"""Every key of a step35 training checkpoint, named once; its writers and readers spell keys only through
these names (tests/test_checkpoint_keys.py checks a saved checkpoint holds no other top-level key).

A training checkpoint is Lightning's checkpoint dict: `torch.save` of it is a `.ckpt` file; a sharded
folder keeps its tensors in DCP shards (under `STATE_DICT` and `optimizer_key(i)`) and the rest in
`META_FILE`. Its top-level keys:
- Lightning's (its checkpoint connector's `dump_checkpoint`): `LIGHTNING_KEYS`;
- step35's, added by `Step35LightningModule.on_save_checkpoint`: `STEP35_KEYS`;
- the data module's resume state (`Step35DataModule.state_dict()`: where the data stream stopped, in
  step35/data/resume.py's format, whose inner keys stay there: data/ imports nothing else of step35),
  under the key Lightning gives a data module's state, its class name: `DATAMODULE_STATE`.
`HYPER_PARAMETERS` and `DATAMODULE_HYPER_PARAMETERS` hold the module's and the data module's init
arguments, read by their argument names (e.g. `checkpoint`, `config`, `lora`; `tokenizer`).

The manifest of a training checkpoint (step35/checkpoint/integrity.py) records in its `extra` what
`manifest_extra` gives, readable without loading the checkpoint (step35/checkpoint/training/catalog.py
orders checkpoints by its `MANIFEST_GLOBAL_STEP`).
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------- Lightning's keys
EPOCH = "epoch"
GLOBAL_STEP = "global_step"
LIGHTNING_VERSION = "pytorch-lightning_version"
STATE_DICT = "state_dict"  # the LightningModule's state: MODEL_PREFIX + the HF tensor name
LOOPS = "loops"
CALLBACKS = "callbacks"
OPTIMIZER_STATES = "optimizer_states"  # a file's full optimizer states, one per optimizer
LR_SCHEDULERS = "lr_schedulers"
HPARAMS_NAME = "hparams_name"
HYPER_PARAMETERS = "hyper_parameters"  # Step35LightningModule's init arguments
DATAMODULE_HPARAMS_NAME = "datamodule_hparams_name"
DATAMODULE_HYPER_PARAMETERS = "datamodule_hyper_parameters"  # Step35DataModule's init arguments
DATAMODULE_STATE = "Step35DataModule"  # Lightning keys a data module's state by its class's __qualname__

LIGHTNING_KEYS = (
    EPOCH,
    GLOBAL_STEP,
    LIGHTNING_VERSION,
    STATE_DICT,
    LOOPS,
    CALLBACKS,
    OPTIMIZER_STATES,
    LR_SCHEDULERS,
    HPARAMS_NAME,
    HYPER_PARAMETERS,
    DATAMODULE_HPARAMS_NAME,
    DATAMODULE_HYPER_PARAMETERS,
)

# ----------------------------------------------------------------------------------------- step35's keys
MODEL_CONFIG = "step35_config"  # the model's config.json as a dict (Step35Config.to_dict): export needs no other
LORA_BASE = (
    "step35_lora_base"  # a LoRA run's: the identity of its frozen base (hf/lora_base.py), left out of STATE_DICT
)
TOKENIZER = "step35_tokenizer"  # the tokenizer files the run trained with and its EOS id (run_tokenizer.record)

STEP35_KEYS = (MODEL_CONFIG, LORA_BASE, TOKENIZER)
ALL_KEYS = LIGHTNING_KEYS + STEP35_KEYS + (DATAMODULE_STATE,)

# ----------------------------------------------------------------------------------------- a sharded folder
META_FILE = "meta.pt"  # Lightning's file of the non-tensor state in a sharded folder
MODEL_PREFIX = "model."  # the LightningModule's attribute holding Step35ForCausalLM: STATE_DICT keys start with it
DCP_MODEL_PREFIX = f"{STATE_DICT}.{MODEL_PREFIX}"  # a model tensor's DCP key: this + its HF name


def optimizer_key(index: int) -> str:
    """The DCP key under which a sharded folder holds optimizer `index`'s state (Lightning's naming)."""
    return f"optimizer_{index}"


# ----------------------------------------------------------------------------------------- its manifest
MANIFEST_KIND = "lightning"  # extra["kind"] of a training checkpoint's manifest (HF folders say "hf" / "peft")
MANIFEST_GLOBAL_STEP = "global_step"
# Whether every floating-point tensor of the weights and optimizer state was finite when saved (over all
# ranks); absent in manifests written before it was recorded. Retention keeps the newest finite checkpoint
# and `--ckpt_path last|auto` passes over non-finite ones (catalog.py, run/resolution.py).
MANIFEST_FINITE = "finite"


def manifest_extra(checkpoint: dict, layout: str, world_size: int = 1) -> dict:
    """What a training checkpoint's manifest records about it (`layout`: "file" or "dcp"); the writer adds
    MANIFEST_FINITE, found while it writes (on a background save's thread: off the training loop)."""
    return {
        "kind": MANIFEST_KIND,
        "layout": layout,
        MANIFEST_GLOBAL_STEP: checkpoint.get(GLOBAL_STEP),
        "epoch": checkpoint.get(EPOCH),
        "world_size": world_size,
    }
