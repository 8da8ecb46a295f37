"""Checkpoints, in two sides over a common part; imports go one way (tests/test_layers.py: APART):

- the common part, here: `errors` (CheckpointError), `publish` (every save is switched in atomically),
  `integrity` (its manifest: sizes and checksums, verified at load), `safe_load` (every load is free
  of code execution). It imports neither side.
- `hf/`: Hugging Face checkpoint folders: the format (`folder`: config.json, safetensors, index),
  filling a meta model from a folder or the init (`materialize`), FP8 folders' block scales and their
  dequantised reading (`fp8`), model <-> folder (`pretrained`),
  PEFT adapter folders (`peft`), the identity of a LoRA run's base folder (`lora_base`), the modeling
  file an export ships (`modeling/`). It uses the common part only.
- `training/`: Lightning training checkpoints: every key they hold (`keys`), how they are written and
  read (`trainer_io`), a run's checkpoints folder (`catalog`), the run's tokenizer record
  (`run_tokenizer`), a checkpoint opened for reading (`trained`) and exported as an HF folder
  (`export`). It may use `hf/` and the common part.
"""
