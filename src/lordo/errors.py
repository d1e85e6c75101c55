"""Errors a user can act on. The CLI prints their message and exits with status 2, no traceback."""


class LordoError(Exception):
    """Base class of every error whose message tells the user what to change."""


class ConfigError(LordoError, ValueError):
    """A configuration value is missing, unknown or outside its allowed range."""


class DataError(LordoError):
    """Corpus archives or prepared token files are missing or corrupt."""
