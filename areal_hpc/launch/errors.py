"""The error the launchers raise. A leaf module (no project imports), so that the launchers, the job
record and the CLI share one definition without importing each other."""


class LaunchError(RuntimeError):
    """The cluster cannot do what the config asks (sbatch rejected it, no such partition, ...); the message
    says what and why, and the CLI prints it."""
