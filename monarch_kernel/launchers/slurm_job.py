"""One launch of the ``slurm`` launcher: its record, and what it submits.

A launch is a batch job (``sbatch``) or, inside the user's allocation, one
``srun`` step; :class:`SlurmUnit` records it (its ranks, job and step ids,
state, nodes, exit) for :class:`~.slurm.SlurmLauncher`. The functions here
compose what is submitted, without running anything:

* :func:`task_script`: the bash each task runs: its rank from
  ``SLURM_PROCID`` (block distribution: ranks are host-major), the rank's
  environment, the mesh key from the key file if there is one, then ``exec
  python -m monarch_kernel worker --rank R``;
* :func:`geometry`: ``--nodes``, ``--ntasks`` (and ``--ntasks-per-node``);
* :func:`batch_script` and :func:`sbatch_command`: a batch job whose script
  runs one ``srun`` step with one task per rank;
* :func:`srun_command`: a step in an existing allocation;
* :func:`job_env`: the environment ``sbatch`` / ``srun`` get (the mesh key
  in it, unless it goes through a file); :func:`write_key_file`: that 0600
  file;
* :func:`task_lines`: one task's lines of the ``srun --label`` output.

The mesh key never appears in argv or in the batch script.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from monarch_kernel.launchers.base import LaunchSpec, worker_command
from monarch_kernel.wire.messages import EXIT_KEEP_ALIVE

__all__ = [
    "SlurmUnit",
    "batch_script",
    "geometry",
    "job_env",
    "sbatch_command",
    "srun_command",
    "task_lines",
    "task_script",
    "write_key_file",
]

_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")


@dataclass
class SlurmUnit:
    """One launch: a batch job, or a step inside the user's allocation."""

    job_id: str
    ranks: list[int]
    step_name: str
    output: str | None
    key_file: str | None = None
    proc: subprocess.Popen | None = None  # the srun of an allocation step
    step: str | None = None
    step_tried: float = 0.0  # when squeue --steps was last asked
    state: str = "PENDING"
    reason: str = ""
    nodes: str = ""
    exit_code: int | None = None
    ended: bool = False
    started: bool = False  # seen running
    next_check: float = 0.0  # when the watcher asks Slurm next
    live: set[int] = field(default_factory=set)  # ranks whose exit is still to report
    leftover_done: set[int] = field(default_factory=set)
    #: the job outlives this controller (never cancelled when it ends)
    detached: bool = False
    #: a step of the user's allocation taken over by attach (no srun of ours):
    #: signals, cancels and liveness concern the step, never the allocation
    step_only: bool = False


def task_script(spec: LaunchSpec, ranks: list[int], key_file: str | None,
                python: str | None, env: dict[str, str] | None = None,
                on_keep_alive: str | None = None) -> str:
    """The bash script each task of the step runs (``bash -c``) for ``ranks``;
    ``env``: variables every task exports (not secrets: the script is kept by
    Slurm, readable by its administrators). With ``on_keep_alive`` (a shell
    command; a detached mesh's) the worker is not ``exec``-ed: when it exits
    with :data:`~monarch_kernel.wire.messages.EXIT_KEEP_ALIVE` (no controller
    within its keep-alive) the command runs, e.g. cancelling what is left of
    the job (a rank stuck in C code cannot run its own keep-alive check)."""
    cmd = worker_command(spec, None, python)
    lines = [
        "set -e",
        f"ranks=({' '.join(str(r) for r in ranks)})",
        'r=${ranks[${SLURM_PROCID:?this script runs as an srun task}]}',
    ]
    if env:
        lines.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    if key_file is not None:
        lines.append(f"MONARCH_MESH_KEY=$(<{shlex.quote(key_file)}); export MONARCH_MESH_KEY")
    cases = [f"{r}) export {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())};;"
             for r, env in spec.env.items() if r in ranks and env]
    if cases:
        lines.append('case "$r" in ' + " ".join(cases) + " esac")
    lines.append('export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"')
    worker = " ".join(shlex.quote(c) for c in cmd) + ' --rank "$r"'
    if on_keep_alive is None:
        lines.append("exec " + worker)
    else:
        # bash stays the worker's parent, which Slurm's process tracking needs to
        # kill a stuck worker: it ignores the TERM and INT Slurm sends every process
        # of the step (the worker installs handlers of its own for both)
        lines += ["trap '' TERM INT", f"rc=0; {worker} || rc=$?",
                  f'if [ "$rc" = {EXIT_KEEP_ALIVE} ]; then {on_keep_alive} || true; fi',
                  'exit "$rc"']
    return "\n".join(lines) + "\n"


def geometry(spec: LaunchSpec, ranks: list[int], nodes: int | None) -> list[str]:
    """``--nodes`` / ``--ntasks`` (/ ``--ntasks-per-node``) for ``ranks``: one node
    per host of the shape unless ``nodes`` says otherwise (one host for a partial
    relaunch)."""
    n = len(ranks)
    hosts = int(spec.shape.get("hosts", 1)) if len(ranks) == spec.world_size else 1
    nodes = min(nodes or hosts, n)
    args = [f"--nodes={nodes}", f"--ntasks={n}"]
    if nodes == hosts and n % nodes == 0:
        args.append(f"--ntasks-per-node={n // nodes}")
    return args


def job_env(spec: LaunchSpec, key_file: str | None) -> dict[str, str]:
    """This process's environment for ``sbatch`` / ``srun``, with the mesh key in
    ``MONARCH_MESH_KEY`` unless it goes through ``key_file``."""
    env = dict(os.environ)
    env.pop("MONARCH_MESH_KEY", None)
    if key_file is None:
        env["MONARCH_MESH_KEY"] = spec.key.hex()
    return env


def write_key_file(key_dir: str, key: bytes) -> str:
    """Write ``key`` (hex) to a new 0600 file in ``key_dir`` (made 0700 if missing);
    its path."""
    os.makedirs(key_dir, mode=0o700, exist_ok=True)
    path = os.path.join(key_dir, f".monarch-key-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())
    return path


def batch_script(spec: LaunchSpec, ranks: list[int], step_name: str, geometry: list[str],
                 task: str, cleanup: Sequence[str] = ()) -> str:
    """The batch script: one ``srun`` step named ``step_name`` whose tasks run ``task``.

    ``cleanup``: files the script removes once the step ended (a detached
    mesh's output and key files, which no controller may be left to remove);
    ``%j`` in them stands for the job id. Without it the script ``exec``s srun.
    """
    srun = (f"srun --job-name={shlex.quote(step_name)} {' '.join(geometry)} "
            "--distribution=block --kill-on-bad-exit=0 --label bash -c \"$task\"")
    head = ("#!/bin/bash\n"
            f"# monarch_kernel mesh {spec.shape} ranks {ranks[0]}..{ranks[-1]}; "
            f"controller {spec.address}\n"
            f"task={shlex.quote(task)}\n")
    if not cleanup:
        return head + f"exec {srun}\n"
    files = " ".join('"$SLURM_JOB_ID"'.join(shlex.quote(p) for p in path.split("%j"))
                     for path in cleanup)
    # srun in the background: a cancelled job's SIGTERM runs the trap at once (a
    # foreground srun would delay it until srun ends, and a stuck task could make
    # that after Slurm's SIGKILL, which runs no trap)
    return head + (f"cleanup() {{ rm -f -- {files}; }}\ntrap cleanup EXIT\n"
                   f"trap 'cleanup; exit 143' TERM\n{srun} &\nwait $!\n")


def sbatch_command(job_name: str, output: str, geometry: list[str], extra_args: Sequence[str],
                   options: dict[str, object]) -> list[str]:
    """The ``sbatch`` command line (the script goes to its stdin); ``options``:
    ``{"--partition": value, ...}``, those whose value is None left out."""
    cmd = ["sbatch", "--parsable", f"--job-name={job_name}",
           f"--output={output}", f"--chdir={os.getcwd()}", "--no-requeue",
           *geometry]
    if not any(a.startswith("--export") for a in extra_args):
        cmd.append("--export=ALL")
    for flag, value in options.items():
        if value is not None:
            cmd.append(f"{flag}={value}")
    cmd += extra_args
    return cmd


def srun_command(job_id: str, step_name: str, geometry: list[str], gpus_per_node: int | None,
                 extra_args: Sequence[str], task: str, overlap: bool) -> list[str]:
    """The ``srun`` command line of a step in allocation ``job_id`` whose tasks run
    ``task`` (``overlap``: share the allocation with the user's other steps,
    Slurm >= 20.11)."""
    cmd = ["srun", f"--jobid={job_id}", f"--job-name={step_name}",
           *geometry, "--distribution=block", "--kill-on-bad-exit=0",
           "--label"]
    if overlap:
        cmd.append("--overlap")  # share the allocation with the user's other steps
    if gpus_per_node is not None:
        cmd.append(f"--gpus-per-node={gpus_per_node}")
    return [*cmd, *extra_args, "bash", "-c", task]


def task_lines(text: str, task: str) -> list[str]:
    """The lines of task ``task`` (its index in the step) in ``srun --label``
    output, without the label, and the unlabelled lines (srun's own)."""
    mine = []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m is None or m.group(1) == task:
            mine.append(line if m is None else m.group(2))
    return mine
