"""Errors a user can act on. The CLI prints their message and exits with status 2, no traceback."""


class LordoError(Exception):
    """Base class of every error whose message tells the user what to change."""


class ConfigError(LordoError, ValueError):
    """A configuration value is missing, unknown or outside its allowed range."""


class DataError(LordoError):
    """Corpus archives or prepared token files are missing or corrupt."""


class NonFiniteError(LordoError):
    """A loss or a pseudo-gradient is NaN or infinite."""


class Stopped(LordoError):
    """The run was stopped by a signal after saving a checkpoint; ``exit_code`` is 128 + the signal."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class WriteError(LordoError, OSError):
    """A file could not be written (a full disk, no permission); the message names the file and the cause."""
