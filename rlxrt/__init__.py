"""rlxrt: exact speculative decoding on ONNX Runtime.

``import rlxrt`` is light: it imports neither onnxruntime nor torch. The heavy
entry points are loaded on first use:

- ``rlxrt.compile(model, config)``  -> ``rlxrt.backends.CompiledGraph``
- ``rlxrt.export(src, out, ...)``    -> an exported model directory (needs ``rlxrt[export]``)
- ``rlxrt.Session(target, speculator)`` and the speculators ``DraftModel``, ``PromptLookup``
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

from .config import Config, load_config
from .errors import (ConfigError, ExportError, GenerationError, InputError, MissingDependencyError,
                     ModelFormatError, ProviderError, RlxrtError, UsageError)
from .manifest import Manifest

__version__ = "0.1.0"

_LAZY = {
    "compile": ("rlxrt.backends", "compile"),
    "CompiledGraph": ("rlxrt.backends", "CompiledGraph"),
    "export": ("rlxrt.app.api", "export"),
    "Session": ("rlxrt.sessions", "Session"),
    "Batch": ("rlxrt.sessions", "Batch"),
    "HeadBatch": ("rlxrt.sessions", "HeadBatch"),
    "Generation": ("rlxrt.sessions", "Generation"),
    "DraftModel": ("rlxrt.sessions", "DraftModel"),
    "PromptLookup": ("rlxrt.sessions", "PromptLookup"),
    "MtpHead": ("rlxrt.sessions", "MtpHead"),
}

__all__ = ["Config", "load_config", "Manifest", "RlxrtError", "ConfigError", "ProviderError",
           "MissingDependencyError", "ModelFormatError", "ExportError", "GenerationError", "InputError", "UsageError",
           "__version__",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(import_module(module), attr)
    raise AttributeError(f"module 'rlxrt' has no attribute {name!r}")
