"""A stand-in for the onnxruntime module whose provider behaviour is scripted."""
from __future__ import annotations

import numpy as np


class FakeOrt:
    """``offered``: what get_available_providers lists; ``works``: what a session really runs on."""

    __version__ = "0.0-fake"

    def __init__(self, offered, works, raises=()):
        self.offered = list(offered)
        self.works = set(works)
        self.raises = set(raises)
        fake = self

        class SessionOptions:
            log_severity_level = 2

        class InferenceSession:
            def __init__(self, model, sess_options=None, providers=()):
                names = [p[0] if isinstance(p, tuple) else p for p in providers]
                for n in names:
                    if n in fake.raises:
                        raise RuntimeError(f"{n}: failed to load shared library libfoo.so")
                used = [n for n in names if n in fake.works]
                if "CPUExecutionProvider" not in used:
                    used.append("CPUExecutionProvider")  # what ORT does: silent CPU fallback
                self._used = used

            def get_providers(self):
                return list(self._used)

            def run(self, outputs, feeds):
                return [feeds["X"] + feeds["X"]]

        self.SessionOptions = SessionOptions
        self.InferenceSession = InferenceSession

    def get_available_providers(self):
        return list(self.offered)
