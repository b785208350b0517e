"""Errors that name the problem in one line (the CLI prints them and exits with code 2)."""


class ModelLoadError(Exception):
    """A model could not be resolved or loaded: unknown name, missing file, malformed or unsupported file."""


class TemplateError(ValueError):
    """A chat template failed to render: it raised, misbehaved, or touched something the sandbox forbids."""
