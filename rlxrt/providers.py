"""The table of execution providers rlxrt knows (pure data, no ORT import).

``rlxrt.backends`` probes these against the installed ONNX Runtime; the
config validates provider names against this table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class ProviderInfo:
    name: str
    """Short name used in config and on the command line (``cuda``)."""
    ort_name: str
    """The name ONNX Runtime uses (``CUDAExecutionProvider``)."""
    install: str
    """What to install to get it: an rlxrt extra or a package name."""
    platforms: tuple[str, ...]
    """``sys.platform`` prefixes it exists on; empty means every platform."""
    default_options: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Provider options passed to ORT unless the config overrides them. None set ``device_id``: ORT's default is
    device 0, and since ONNX Runtime 1.26 a ``device_id`` option makes it look for a registered plugin EP device
    first and log "No registered plugin EP device found" at every session before it takes the built-in provider
    (a ``device_id`` the config sets still logs it; the session is the same)."""


PROVIDERS: tuple[ProviderInfo, ...] = (
    ProviderInfo("cpu", "CPUExecutionProvider", "pip install 'rlxrt[cpu]'", ()),
    ProviderInfo("cuda", "CUDAExecutionProvider", "pip install 'rlxrt[cuda]'", ("linux", "win32")),
    ProviderInfo("tensorrt", "TensorrtExecutionProvider", "pip install 'rlxrt[cuda]' (plus TensorRT libraries)",
                 ("linux", "win32")),
    ProviderInfo("coreml", "CoreMLExecutionProvider", "pip install 'rlxrt[cpu]' on macOS", ("darwin",)),
    ProviderInfo("directml", "DmlExecutionProvider", "pip install onnxruntime-directml (instead of onnxruntime)",
                 ("win32",)),
    ProviderInfo("openvino", "OpenVINOExecutionProvider", "pip install onnxruntime-openvino (instead of onnxruntime)",
                 ("linux", "win32")),
    ProviderInfo("qnn", "QNNExecutionProvider", "pip install onnxruntime-qnn (instead of onnxruntime)",
                 ("win32", "linux")),
    ProviderInfo("rocm", "ROCMExecutionProvider", "pip install onnxruntime-rocm (instead of onnxruntime)", ("linux",)),
    ProviderInfo("migraphx", "MIGraphXExecutionProvider", "pip install onnxruntime-migraphx (instead of onnxruntime)",
                 ("linux",)),
    ProviderInfo("webgpu", "WebGpuExecutionProvider", "pip install onnxruntime-webgpu (instead of onnxruntime)", ()),
)

BY_NAME: Mapping[str, ProviderInfo] = MappingProxyType({p.name: p for p in PROVIDERS})
BY_ORT_NAME: Mapping[str, ProviderInfo] = MappingProxyType({p.ort_name: p for p in PROVIDERS})
NAMES: tuple[str, ...] = tuple(p.name for p in PROVIDERS)


def short_name(ort_name: str) -> str:
    """``CUDAExecutionProvider`` -> ``cuda``; unknown ORT names are returned unchanged."""
    info = BY_ORT_NAME.get(ort_name)
    return info.name if info else ort_name
