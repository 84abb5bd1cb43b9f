"""Exceptions the core raises for people to read: each says what was wrong and what to do."""


class ChituError(Exception):
    """Base class of every error chitu-core raises on purpose."""


class PluginError(ChituError):
    """A plugin could not be found, imported or accepted (e.g. contract version mismatch)."""


class BackendNotFound(PluginError):
    """The requested backend is not installed (the message names the package to install)."""


class BackendUnavailable(PluginError):
    """The backend is installed but cannot run here (the message gives its reason)."""


class ModelLoadError(ChituError):
    """A model directory or checkpoint could not be loaded (unknown architecture,
    missing or misshapen tensor, corrupt file)."""
