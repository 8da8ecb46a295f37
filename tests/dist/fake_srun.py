"""What `srun --ntasks-per-node=N --kill-on-bad-exit` does for one node, for tests on a machine without SLURM:
start N copies of a command with the variables srun gives each task (SLURM_PROCID, SLURM_LOCALID,
SLURM_NTASKS, ...), end the others when one fails, and exit with the first failure's code (0 when all succeed).

    python tests/dist/fake_srun.py --ntasks 2 [--job-id 4242] -- python -m step35 fit ...
"""

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_environment(rank: int, ntasks: int, job_id: str, port: int) -> dict:
    return {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": "0",
            "SLURM_JOB_NAME": "step35-test", "SLURM_NTASKS": str(ntasks), "SLURM_NTASKS_PER_NODE": str(ntasks),
            "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ntasks", type=int, required=True)
    parser.add_argument("--job-id", default=str(random.randrange(10**5, 10**6)))
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    port = free_port()
    tasks = [subprocess.Popen(command, env=task_environment(rank, args.ntasks, args.job_id, port))
             for rank in range(args.ntasks)]
    signal.signal(signal.SIGTERM, lambda *a: [t.terminate() for t in tasks])
    code = 0
    while any(t.poll() is None for t in tasks):
        failed = [t.returncode for t in tasks if t.returncode not in (None, 0)]
        if failed and code == 0:
            code = failed[0]
            for t in tasks:  # --kill-on-bad-exit
                if t.poll() is None:
                    t.terminate()
        time.sleep(0.1)
    failed = [t.returncode for t in tasks if t.returncode != 0]
    return code or (failed[0] if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
