"""rlxrt.backends: execution providers, compile() and the compiled-graph cache.

The only sub-package that creates ONNX Runtime sessions.
"""
from .compile import CompiledGraph, TensorSpec, compile, session_options
from .registry import ProviderStatus, Registry, Resolution, default_registry

__all__ = ["CompiledGraph", "TensorSpec", "compile", "session_options", "ProviderStatus", "Registry",
           "Resolution", "default_registry"]
