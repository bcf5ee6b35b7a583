"""The exception every configuration check raises."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""
