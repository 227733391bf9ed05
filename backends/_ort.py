"""Import ONNX Runtime, or say which extra brings it."""
from __future__ import annotations

from types import ModuleType

from rlxrt.errors import MissingDependencyError

INSTALL_HINT = ("pip install 'rlxrt[cpu]' (CPU; CoreML on macOS) or 'rlxrt[cuda]' (NVIDIA GPUs) "
                "— exactly one of them: both install the same onnxruntime module")


def import_ort() -> ModuleType:
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingDependencyError(f"onnxruntime is not installed ({exc}); {INSTALL_HINT}") from None
    if not hasattr(onnxruntime, "InferenceSession"):
        raise MissingDependencyError(
            "the onnxruntime module is broken (no InferenceSession): onnxruntime and onnxruntime-gpu were both "
            f"installed and one was removed; reinstall one of them: {INSTALL_HINT}"
        )
    return onnxruntime


def ort_errors(ort: ModuleType) -> tuple[type[Exception], ...]:
    """The exception classes ONNX Runtime raises from a run (Fail, InvalidArgument, RuntimeException, …,
    and RuntimeError / MemoryError from its bindings): what sessions turn into GenerationError. Anything
    else raised in rlxrt is a bug and propagates as is."""
    state = getattr(getattr(ort, "capi", None), "onnxruntime_pybind11_state", None)
    found = tuple(v for v in vars(state).values()
                  if isinstance(v, type) and issubclass(v, Exception)) if state is not None else ()
    return found + (RuntimeError, MemoryError)
