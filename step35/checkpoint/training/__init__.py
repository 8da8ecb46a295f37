"""Lightning training checkpoints: their keys, writing and reading them, a run's checkpoints folder, and their
export to an HF folder (step35/checkpoint/__init__.py says what lives where). May use `hf/` and the common part."""
