"""The controller's exit codes, and where it writes why it stopped, which the launchers act on. A leaf
module (no imports) so that the controller, the local launcher and the sbatch renderer share one
definition."""

EXIT_DONE = 0
"""The run finished (train.total_steps reached)."""
EXIT_STOPPED = 75
"""Exit code after a stop request (SIGUSR2, SIGTERM, SIGINT, or the launcher's STOP file), once the
checkpoint is saved or when there is no time for one: "resume me" (EX_TEMPFAIL). The sbatch script
(areal_hpc/launch/sbatch.py) requeues the job on it; `areal-hpc run` (areal_hpc/launch/local.py) says how to resume."""

STOP_REASON_ENV = "AREAL_STOP_REASON_FILE"
"""Where the Slurm batch script wants the controller's stop reason (areal_hpc/launch/templates/hetjob.sbatch): Slurm
signals only the tasks at a preemption, so the script learns of it from the controller."""
