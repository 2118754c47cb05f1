"""Exceptions raised for bad input. Every message says what was wrong and how to fix it."""


class SpeculantError(Exception):
    """Base class: the CLI prints the message and exits with status 2."""


class ConfigError(SpeculantError, ValueError):
    """An invalid argument or setting (sampling, tree spec, method, lengths)."""


class ModelLoadError(SpeculantError):
    """A model spec that cannot be resolved or loaded (missing, corrupt, unsupported)."""


class VocabMismatchError(SpeculantError):
    """Draft and target models do not share a vocabulary."""
