"""The transformers modeling file `step35 export` writes into an export (docs/checkpoints.md, "Loading an
export"). step35 never imports it: it is package data, read as text and copied next to the weights, where
transformers loads it with `trust_remote_code=True`. It imports only torch and transformers."""

from pathlib import Path

MODELING_FILE = Path(__file__).with_name("modeling_step35.py")
# config.json's auto_map for it: the config class and the causal LM, both in the one file.
AUTO_MAP = {"AutoConfig": "modeling_step35.Step3p5Config", "AutoModelForCausalLM": "modeling_step35.Step3p5ForCausalLM"}
