"""Which launcher started this process, and where it stands in its job, before any process group exists.

A training job is one or more processes started one of four ways, and each process must know, before the
Trainer is built, whether it is the job's global rank 0 (the one that takes the run folder's lock, tidies
it, resolves `--ckpt_path` and writes config.yaml) and what identifies its job (so that the other ranks
recognise rank 0's lock as their own job's, and a second job's as not):

- torchrun: every rank is a child of the agent, with RANK, LOCAL_RANK, WORLD_SIZE and TORCHELASTIC_*;
- SLURM's srun: every task is started by slurmstepd, with SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, ...;
- LSF's jsrun or an MPI launcher (Lightning's LSFEnvironment / MPIEnvironment);
- Lightning's own launcher (`step35 fit --trainer.devices N`): the process the user started is local rank
  0; once its Trainer starts fitting it runs the same command line again for local ranks 1..N-1, with
  LOCAL_RANK, NODE_RANK and WORLD_SIZE set, after having set MASTER_ADDR/MASTER_PORT in its own
  environment. On further nodes the user starts the command with NODE_RANK (and MASTER_ADDR/PORT).

The launcher is chosen exactly as Lightning's Trainer chooses its cluster environment (the order of
`_AcceleratorConnector._choose_and_init_cluster_environment` in Lightning 2.6: torchelastic first, it can
run inside SLURM; then SLURM (srun used, not an interactive `bash` job), LSF, MPI; else Lightning's own),
and the ranks are read through the same public environment classes, so step35 and the Trainer never
disagree about who is rank 0. A `cluster_environment` plugin given to the Trainer explicitly is not seen
here: such a setup sets RANK-style variables of one of the launchers above.
"""

from __future__ import annotations

import os
import uuid
import warnings
from dataclasses import dataclass, field, replace

# Set by a Lightning-launched job's rank 0 before the Trainer starts its other local ranks, which inherit it:
# what they recognise their job by (the launcher gives them nothing that rank 0 had at start).
JOB_VARIABLE = "STEP35_JOB"

# Per launcher: the variables that are equal on every rank of one job and differ between two jobs.
_JOB_VARIABLES = {
    "torchrun": ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"),
    "slurm": ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"),
    "lsf": ("LSB_JOBID", "MASTER_ADDR", "MASTER_PORT"),
    "mpi": ("MASTER_ADDR", "MASTER_PORT"),
    "lightning": ("MASTER_ADDR", "MASTER_PORT"),
}

# Per launcher: the variables that give a process its place (what a shell may have left over from another job).
_RANK_VARIABLES = {
    "torchrun": ("TORCHELASTIC_RUN_ID", "RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"),
    "lsf": ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE"),
    "mpi": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    "lightning": ("NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE"),
}
# The variables Lightning's rank_zero_only takes its rank from at import, the first one set
# (lightning.fabric.utilities.rank_zero._get_rank): what decides whether its messages, logs and progress show.
_LIGHTNING_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


@dataclass(frozen=True)
class JobPlace:
    """This process's place in its job, as the launcher set it."""

    launcher: str  # torchrun, slurm, lsf, mpi, lightning (Lightning's launcher, or one process from a shell)
    node_rank: int
    local_rank: int
    global_rank: int | None  # None: not known yet (Lightning's launcher on a node > 0, devices per node unknown)
    world_size: int | None  # None: not known yet (a Lightning-launched rank 0 before it starts the others)
    job: dict[str, str] = field(default_factory=dict)  # the job's identifying variables present in this process
    set_by: dict[str, str] = field(default_factory=dict)  # the launcher's variables that gave this place

    @property
    def is_rank_zero(self) -> bool:
        """The job's global rank 0 (the process that owns the run folder for the job)."""
        return self.node_rank == 0 and self.local_rank == 0 if self.global_rank is None else self.global_rank == 0

    @property
    def started_by_launcher(self) -> bool:
        """A child process of a launcher that stays alive beside it (torchrun's agent, or the Lightning-launched
        local rank 0 for its local ranks 1..N-1); the process a user started from a shell is not."""
        return self.launcher == "torchrun" or (self.launcher == "lightning" and self.local_rank > 0)

    @property
    def launcher_pid(self) -> int | None:
        """The pid of the Lightning-launched rank that started this process (its job id begins with it), so
        that a process whose launcher died before it looked at its parent still knows whom to watch."""
        head = self.job.get(JOB_VARIABLE, "").split("-", 1)[0]
        return int(head) if head.isdigit() else None

    def describe(self) -> str:
        """'rank 3' or 'node 1, local rank 0' (when the global rank is not known yet)."""
        if self.global_rank is not None:
            return f"rank {self.global_rank}"
        return f"node {self.node_rank}, local rank {self.local_rank}"

    def origin(self) -> str:
        """'a torchrun job (RANK=1, LOCAL_RANK=1, WORLD_SIZE=2 in the environment)': why this process has its place."""
        if not self.set_by:
            return f"a job started from a shell (no {self.launcher} launcher variables in the environment)"
        variables = ", ".join(f"{k}={v}" for k, v in self.set_by.items())
        return f"a {self.launcher} job ({variables} in the environment)"

    def same_job(self, recorded: dict) -> bool:
        """Whether `recorded` (rank 0's `job` variables, from the lock file) is this process's own job."""
        if JOB_VARIABLE in self.job:
            # Lightning's local ranks 1..N-1 of node 0, started by rank 0 itself with its environment: the
            # port was chosen after rank 0 wrote the record, so only the inherited job id can be compared
            return recorded.get(JOB_VARIABLE) == self.job[JOB_VARIABLE]
        return bool(self.job) and all(recorded.get(k) == v for k, v in self.job.items())


def _environment() -> tuple[str, object | None]:
    """The launcher's name and Lightning's cluster environment for it (None for Lightning's own launcher)."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    with warnings.catch_warnings():
        # SLURM's "srun is available but not used" hint: the Trainer itself says it once, later.
        warnings.simplefilter("ignore")
        for name, env_type in (
            ("torchrun", TorchElasticEnvironment),
            ("slurm", SLURMEnvironment),
            ("lsf", LSFEnvironment),
            ("mpi", MPIEnvironment),
        ):
            if env_type.detect():
                return name, env_type()
    return "lightning", None


def place_of_environment(devices_per_node: int | None = None) -> JobPlace:
    """The place the environment (os.environ) gives this process now. `devices_per_node` (the Trainer's
    `devices`) completes the global rank of a Lightning-launched process on a node > 0."""
    environ = os.environ
    launcher, env = _environment()
    job = {k: environ[k] for k in _JOB_VARIABLES[launcher] if environ.get(k)}
    set_by = {k: environ[k] for k in _RANK_VARIABLES[launcher] if environ.get(k)}
    if env is not None:
        return JobPlace(
            launcher, env.node_rank(), env.local_rank(), env.global_rank(), env.world_size(), job=job, set_by=set_by
        )
    node = int(environ.get("NODE_RANK", environ.get("GROUP_RANK", 0)))
    local = int(environ.get("LOCAL_RANK", 0))
    world = int(environ["WORLD_SIZE"]) if environ.get("WORLD_SIZE") else None
    if node == 0:
        rank = local
    else:
        rank = node * devices_per_node + local if devices_per_node else None
    if environ.get(JOB_VARIABLE) and node == 0 and local > 0:
        job[JOB_VARIABLE] = environ[JOB_VARIABLE]
    return JobPlace("lightning", node, local, rank, world, job=job, set_by=set_by)


def lightning_rank_mismatch(place: JobPlace) -> str | None:
    """A line when the rank Lightning's rank_zero_only reads from the environment is not this process's rank
    (`RANK=1` left in a shell: a one-process run that trains and saves but shows nothing); else None."""
    name = next((k for k in _LIGHTNING_RANK_VARIABLES if os.environ.get(k) is not None), None)
    if name is None or place.global_rank is None or not os.environ[name].strip().isdigit():
        return None
    if int(os.environ[name]) == place.global_rank:
        return None
    return (
        f"{name}={os.environ[name]} is set, but this process is {place.describe()} of {place.origin()}: Lightning "
        f"takes {name} for its rank and shows nothing (no progress, metrics or messages) when it is not 0. "
        f"Unset {name} (left over from another job?), or start the job with its launcher"
    )


_THIS_PROCESS: JobPlace | None = None
_STARTED_ID: str | None = None  # the job id this process gave its job (start_job_identity)


def this_process(devices_per_node: int | None = None, fresh: bool = False) -> JobPlace:
    """This process's place, read once (by the first call, or anew with `fresh`: a command's start, before
    the Trainer exists): Lightning's launcher later writes LOCAL_RANK=0 and WORLD_SIZE into rank 0's own
    environment, which must not make it look like one of the processes it started. A later call may
    complete an unknown global rank."""
    global _THIS_PROCESS, _STARTED_ID
    if fresh:
        _THIS_PROCESS = _STARTED_ID = None
    if _THIS_PROCESS is None or (_THIS_PROCESS.global_rank is None and devices_per_node):
        first, _THIS_PROCESS = _THIS_PROCESS, place_of_environment(devices_per_node)
        if first is not None:  # only the rank is completed; the rest stays as read first
            _THIS_PROCESS = replace(first, global_rank=_THIS_PROCESS.global_rank)
    return _THIS_PROCESS


def start_job_identity() -> dict[str, str]:
    """On the job's rank 0: this job's identifying variables, after giving it a fresh STEP35_JOB id that
    the processes Lightning's launcher starts from this one inherit (a value inherited from whoever ran
    this process is replaced). The dict is what rank 0 records in the run folder's lock. (On a node > 0,
    Lightning's local ranks compare MASTER_ADDR/MASTER_PORT, which a multi-node launch sets everywhere.)"""
    global _STARTED_ID
    place = this_process()
    if _STARTED_ID is None:  # once per command: every lock this job takes records the same id
        _STARTED_ID = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ[JOB_VARIABLE] = _STARTED_ID
    return {**place.job, JOB_VARIABLE: _STARTED_ID}
