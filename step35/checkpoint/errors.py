"""The one error type of the checkpoint package (no imports: every checkpoint module may use it)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: the message names the file (or tensor) and what is wrong."""
