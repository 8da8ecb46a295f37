"""Every key of a training checkpoint is named in step35/checkpoint/training/keys.py: a saved checkpoint
holds no other top-level key, and step35's own keys are spelled nowhere else in step35/."""

import re
from pathlib import Path

from step35.checkpoint.training import keys
from step35.checkpoint.training.trainer_io import load_file
from step35.run import checkpoint_of

PACKAGE = Path(__file__).parent.parent / "step35"


def test_a_saved_checkpoint_holds_only_the_named_keys(tiny_run):
    run, _ = tiny_run
    saved = load_file(checkpoint_of(run))
    assert set(saved) <= set(keys.ALL_KEYS), sorted(set(saved) - set(keys.ALL_KEYS))
    # step35's own (a run without LoRA records no base), the weights, the options and the data position
    assert {
        keys.MODEL_CONFIG,
        keys.TOKENIZER,
        keys.STATE_DICT,
        keys.OPTIMIZER_STATES,
        keys.HYPER_PARAMETERS,
        keys.DATAMODULE_STATE,
    } <= set(saved)
    assert keys.LORA_BASE not in saved
    assert all(name.startswith(keys.MODEL_PREFIX) for name in saved[keys.STATE_DICT])


def test_the_data_module_state_is_keyed_by_its_class_name():
    from step35.data import Step35DataModule

    assert keys.DATAMODULE_STATE == Step35DataModule.__qualname__


def test_step35_keys_are_spelled_only_in_keys_py():
    """The literal "step35_config" etc. appears in keys.py alone (and as hf/peft.py's names of the same
    records in a PEFT folder's metadata): every other writer and reader goes through keys.*."""
    spelled = re.compile("|".join(rf"[\"']{re.escape(key)}[\"']" for key in keys.STEP35_KEYS))
    allowed = {PACKAGE / "checkpoint" / "training" / "keys.py", PACKAGE / "checkpoint" / "hf" / "peft.py"}
    offenders = [
        f"{file.relative_to(PACKAGE)}:{i}"
        for file in sorted(PACKAGE.rglob("*.py"))
        if file not in allowed
        for i, line in enumerate(file.read_text().splitlines(), 1)
        if spelled.search(line)
    ]
    assert not offenders
