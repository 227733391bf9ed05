"""Per-call inputs under a device's binding semantics, emulated on the CPU.

On CUDA, IOBinding copies a host input that a device node consumes when it is bound, so a fused model that
binds its per-call inputs once and then writes the arrays in place feeds the graph stale ids and lengths
(FACTS.md; the prefill failed with a tensor size mismatch, and equal shapes would be silent garbage). Here a
binding that snapshots every per-call input when it is bound stands in for that device; a model that knows its
inputs do not alias (``aliases_inputs`` False) binds them again at every call and must decode exactly as on
the CPU, while the bind-once path under the same emulation must not (so the emulation is not vacuous).
"""
import numpy as np
import onnxruntime as ort
import pytest

from rlxrt import Config, compile
from rlxrt.app.reference import reference_pair
from rlxrt.sessions import DraftModel, PromptLookup, Session

CFG = Config(intra_op_threads=1, cache=False)
TARGET, DRAFT = reference_pair()
PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n\nfor i in range(10):\n"]
PER_CALL = ("input_ids", "seqlens_k", "total_sequence_length", "num_logits", "greedy")


class CopyAtBind:
    """An IOBinding whose per-call inputs are copied when bound, as a CUDA session copies host inputs."""

    def __init__(self, binding, names):
        self._binding, self._names = binding, set(names)

    def bind_ortvalue_input(self, name, value):
        if name in self._names:
            value = ort.OrtValue.ortvalue_from_numpy(np.array(value.numpy(), copy=True))
            self._keep = getattr(self, "_keep", {})
            self._keep[name] = value  # the copy lives as long as it is bound
        self._binding.bind_ortvalue_input(name, value)

    def __getattr__(self, attr):  # everything else, and ``_iobinding`` for run_with_iobinding
        return getattr(self._binding, attr)


def emulated(path, monkeypatch, alias: bool):
    """A compiled graph whose bindings copy per-call inputs at bind time; the model is told whether its
    inputs alias (as on the CPU) or not (as on a device)."""
    graph = compile(path, CFG)
    names = [graph.manifest.inputs[r] for r in PER_CALL if graph.manifest.inputs.get(r)]
    real = graph.session.io_binding
    graph.session.io_binding = lambda: CopyAtBind(real(), names)
    monkeypatch.setattr("rlxrt.sessions.fused.aliases_inputs", lambda g: alias)
    return graph


def runs(session):
    out = [session.generate(p, max_new_tokens=48, ignore_eos=True).token_ids for p in PROMPTS]
    out += [session.generate(p, max_new_tokens=32, temperature=0.8, seed=i, ignore_eos=True).token_ids
            for i, p in enumerate(PROMPTS)]
    return out


@pytest.fixture(scope="module")
def reference():
    return {name: runs(Session(TARGET, make(), CFG, k=4)) for name, make in
            (("draft", lambda: DraftModel(DRAFT, CFG)), ("lookup", PromptLookup), ("plain", lambda: None))}


@pytest.mark.parametrize("name", ["draft", "lookup", "plain"])
def test_inputs_bound_at_every_call_decode_as_on_the_cpu(reference, monkeypatch, name):
    target = emulated(TARGET, monkeypatch, alias=False)
    spec = {"draft": lambda: DraftModel(emulated(DRAFT, monkeypatch, alias=False)), "lookup": PromptLookup,
            "plain": lambda: None}[name]()
    session = Session(target, spec, CFG, k=4)
    assert runs(session) == reference[name]
    if name != "plain":
        assert session.stats.drafted > session.stats.accepted > 0  # rollbacks happened


def test_binding_once_under_copy_at_bind_goes_wrong(reference, monkeypatch):
    """The negative control: the bind-once path (right on the CPU) under the emulated device fails, as the
    CUDA run did; so the test above would catch a per-call input left out of the rebinding."""
    target = emulated(TARGET, monkeypatch, alias=True)
    try:
        got = runs(Session(target, None, CFG))
    except Exception as exc:  # stale lengths put the new tokens outside the KV buffer, or shapes mismatch
        assert "onnxruntime failed" in str(exc)
        return
    assert got != reference["plain"]


def test_the_cpu_aliases_and_other_providers_do_not():
    from types import SimpleNamespace

    from rlxrt.sessions.fused import aliases_inputs

    assert aliases_inputs(SimpleNamespace(providers=["cpu"]))
    assert not aliases_inputs(SimpleNamespace(providers=["cuda", "cpu"]))
    assert not aliases_inputs(SimpleNamespace(providers=["coreml", "cpu"]))
    assert not aliases_inputs(SimpleNamespace(providers=[]))
