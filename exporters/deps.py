"""Import the export stack (torch, transformers, optimum-onnx), or say which extra brings it."""
from __future__ import annotations

from rlxrt.errors import MissingDependencyError

HINT = "pip install 'rlxrt[export]' (after `pip install torch==2.13.0` for the CPU build of torch)"


def require_export_stack():
    """Return (torch, transformers, optimum.exporters.onnx); MissingDependencyError names the extra."""
    try:
        import torch
        import transformers
        from optimum.exporters import onnx as optimum_onnx
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        raise MissingDependencyError(f"exporting needs {missing}, which is not installed; {HINT}") from None
    return torch, transformers, optimum_onnx


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("rlxrt", "torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out
