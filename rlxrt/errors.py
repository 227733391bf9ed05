"""The one error hierarchy of rlxrt.

Every error a user can cause is an ``RlxrtError``; its message names the
offending value and the fix. ``assert`` is kept for internal invariants.
"""
from __future__ import annotations


class RlxrtError(Exception):
    """Base class of every error rlxrt raises on purpose."""


class ConfigError(RlxrtError, ValueError):
    """A configuration key or value is unknown or out of range."""


class ProviderError(RlxrtError):
    """An execution provider is unknown, unavailable, or was silently replaced."""


class MissingDependencyError(RlxrtError, ImportError):
    """An optional dependency (an extra) is not installed."""


class ModelFormatError(RlxrtError):
    """A model file or model directory is missing, unreadable or inconsistent."""


class ExportError(RlxrtError):
    """Exporting a Hugging Face model to ONNX failed or did not validate."""


class GenerationError(RlxrtError, ValueError):
    """A generation request is invalid (bad prompt, bad sampling parameter, …)."""


class UsageError(RlxrtError, ValueError):
    """Command-line options or arguments that are malformed, missing, or exclude each other (exit code 2)."""


class InputError(RlxrtError, ValueError):
    """A value or file the user gave is unusable: a number outside its range, or a file (prompt file, prompt
    list, corpus) that is missing, unreadable, too large, not UTF-8 or not what its flag takes (exit code 1)."""
