"""Errors shared across packages, in a leaf module (no project imports): the one a user's configuration
raises, so that config, layout and planner, which check a config, share one definition without importing
each other; and the one the controller raises for a failed rank, which every rank's failure path
(areal_hpc.main) recognises without importing the controller."""


class ConfigError(ValueError):
    """A configuration a user wrote (or overrode) that cannot run; the message says why."""


class RankFailure(RuntimeError):
    """A rank failed or hung; the message names it. main.py ends the whole run (MPI Abort)."""
