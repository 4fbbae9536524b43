"""The error a user's configuration raises. A leaf module (no project imports), so that config, layout
and planner, which check a config, share one definition without importing each other."""


class ConfigError(ValueError):
    """A configuration a user wrote (or overrode) that cannot run; the message says why."""
