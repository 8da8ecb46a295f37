"""Hugging Face checkpoint folders: read, checked, filled into a model, written (step35/checkpoint/__init__.py
says what lives where). Nothing here knows a training checkpoint: `training/` imports this side, never the reverse."""
