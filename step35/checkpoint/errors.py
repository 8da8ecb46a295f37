"""The error type of the checkpoint package, and how ranks raise it together (imports nothing at load:
every checkpoint module may use it)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: the message names the file (or tensor) and what is wrong."""

    step35_refusal = True  # said in one line, without a traceback (step35.faults)


def raise_together(check):
    """Run `check()` on every rank; when it raises a CheckpointError on any rank, raise that error on
    all of them (one line, naming the file) instead of leaving the others waiting in a collective.
    Without a process group it is just `check()`. Returns check()'s value."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return check()
    try:
        value, error = check(), None
    except CheckpointError as e:
        value, error = None, str(e)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)
    return value
