"""Which execution providers really work here, and the list handed to ORT.

A provider is *available* only when a probe session — a one-node graph built
with ``onnx.helper`` — actually runs on it. ``onnxruntime-gpu`` lists CUDA even
without a GPU and then silently runs on CPU; the probe sees that.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from rlxrt.config import Config
from rlxrt.errors import MissingDependencyError, ProviderError
from rlxrt.providers import BY_NAME, PROVIDERS, ProviderInfo

from ._ort import import_ort

log = logging.getLogger("rlxrt")


@dataclass(frozen=True)
class ProviderStatus:
    """Whether one provider can run here, and if not, why and what to do."""

    name: str
    ort_name: str
    available: bool
    reason: str
    """Empty when available; otherwise a sentence a person can act on."""
    install: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ort_name": self.ort_name, "available": self.available,
                "reason": self.reason, "install": self.install}


@dataclass(frozen=True)
class Resolution:
    """The outcome of turning a preference list into what ORT gets."""

    providers: list[tuple[str, dict[str, str]]]
    """(ORT name, options) in order, handed to InferenceSession."""
    names: list[str]
    """Short names of the providers handed to ORT."""
    fallbacks: list[str] = field(default_factory=list)
    """One sentence per preferred provider that could not be used."""


def probe_model_bytes() -> bytes:
    """A one-node float graph (Y = X + X) for probing a provider."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Add", ["X", "X"], ["Y"])], "rlxrt_probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


class Registry:
    """Probes providers against one ONNX Runtime module (injectable for tests)."""

    def __init__(self, ort: ModuleType | None = None, platform: str | None = None):
        self._ort = ort
        self._ort_error: str | None = None
        self.platform = platform or sys.platform
        self._status: dict[str, ProviderStatus] = {}

    @property
    def ort(self) -> ModuleType | None:
        if self._ort is None and self._ort_error is None:
            try:
                self._ort = import_ort()
            except MissingDependencyError as exc:
                self._ort_error = str(exc)
        return self._ort

    def status(self, name: str) -> ProviderStatus:
        if name not in BY_NAME:
            raise ProviderError(f"unknown provider {name!r}; known providers: {', '.join(BY_NAME)}")
        if name not in self._status:
            self._status[name] = self._probe(BY_NAME[name])
        return self._status[name]

    def all(self) -> list[ProviderStatus]:
        return [self.status(p.name) for p in PROVIDERS]

    def _probe(self, info: ProviderInfo) -> ProviderStatus:
        def no(reason: str) -> ProviderStatus:
            return ProviderStatus(info.name, info.ort_name, False, reason, info.install)

        ort = self.ort
        if ort is None:
            return no(self._ort_error or "onnxruntime is not installed")
        if info.platforms and not any(self.platform.startswith(p) for p in info.platforms):
            return no(f"{info.name} exists only on {', '.join(info.platforms)}; this machine is {self.platform}")
        offered = list(ort.get_available_providers())
        if info.ort_name not in offered:
            return no(f"not in this onnxruntime build (version {getattr(ort, '__version__', '?')} offers "
                      f"{', '.join(offered) or 'nothing'}); to get it: {info.install}")
        try:
            opts = ort.SessionOptions()
            opts.log_severity_level = 4
            sess = ort.InferenceSession(probe_model_bytes(), sess_options=opts,
                                        providers=[(info.ort_name, dict(info.default_options))])
            used = list(sess.get_providers())
            if not used or used[0] != info.ort_name:
                hint = (" (its CUDA/cuDNN libraries or the GPU driver were not found)"
                        if info.name in ("cuda", "tensorrt") else "")
                return no(f"onnxruntime offers it, but a session asked for it silently ran on "
                          f"{', '.join(used) or 'nothing'}{hint}")
            x = np.array([1.5, -2.0], dtype=np.float32)
            (y,) = sess.run(["Y"], {"X": x})
            if not np.allclose(y, x + x):
                return no(f"a probe session on it returned a wrong result {y!r}")
        except Exception as exc:  # ORT raises several unrelated types here
            return no(f"creating a probe session on it failed: {str(exc).strip().splitlines()[0][:300]}")
        return ProviderStatus(info.name, info.ort_name, True, "", info.install)

    def resolve(self, config: Config) -> Resolution:
        """Turn ``config.providers`` into the list handed to ORT.

        An unavailable preferred provider raises under ``config.strict``;
        otherwise it is logged as a warning and recorded in ``fallbacks``.
        """
        chosen: list[str] = []
        fallbacks: list[str] = []
        for name in config.providers:
            st = self.status(name)
            if st.available:
                chosen.append(name)
                continue
            msg = f"provider {name!r} is unavailable: {st.reason}"
            if config.strict:
                raise ProviderError(f"{msg}. Fix it, or drop {name!r} from the providers (strict mode is on)")
            fallbacks.append(msg)
            log.warning("%s; falling back", msg)
        if not chosen:
            cpu = self.status("cpu")
            if not cpu.available:
                raise ProviderError(f"no execution provider is available: {cpu.reason}")
            chosen.append("cpu")
            fallbacks.append(f"none of {', '.join(config.providers)} is available; using cpu")
            log.warning("none of the configured providers (%s) is available; using cpu",
                        ", ".join(config.providers))
        providers = []
        for name in chosen:
            info = BY_NAME[name]
            opts = dict(info.default_options)
            opts.update(config.provider_options.get(name, {}))
            providers.append((info.ort_name, opts))
        return Resolution(providers=providers, names=chosen, fallbacks=fallbacks)


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry over the installed onnxruntime (probes run once)."""
    global _default
    if _default is None:
        _default = Registry()
    return _default
