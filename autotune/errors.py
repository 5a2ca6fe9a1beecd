"""The error of bad input, below every layer: a config, space, workload, flag or file that is not allowed."""


class ConfigError(ValueError):
    """A config, space or workload value that is not allowed; the message names it (one line)."""
