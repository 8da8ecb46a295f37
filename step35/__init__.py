"""step35: train Step-3.5-Flash with PyTorch Lightning (FSDP2 + expert parallel), from the HF checkpoint or from scratch."""

__version__ = "0.1.0"
