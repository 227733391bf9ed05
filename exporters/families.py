"""The export families: which exporter writes the graph of a model type.

    attention   optimum-onnx's graph with a KV cache, fp32 / fp16 / int8        attention.py
    mamba       rlxrt's own graph with per-position states (Mamba, FalconMamba)  mamba.py
    jamba       rlxrt's own hybrid graph: Mamba states and a KV cache            jamba.py

Every exporter has the members of ``Exporter``; ``export.export_model`` runs
them in order and knows no family by name.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rlxrt.errors import ExportError
from rlxrt.manifest import Manifest

from . import jamba, mamba
from .attention import Attention, supported_model_types
from .hidden import HIDDEN


class Exporter(Protocol):
    task: str
    """What the graph computes, recorded as ``source.task`` in the manifest."""

    def export(self, steps, torch, model, graph: Path, variant: str, with_hidden: bool) -> None:
        """Write the graph file ``graph`` (its folder exists; scratch goes in a sibling folder), timing each
        step with ``steps.run(name, fn, *args)``."""

    def layout(self, model, graph: Path, variant: str, with_hidden: bool) -> dict:
        """The manifest fields the family decides: dtype, inputs, outputs, kv_cache, state, max_positions."""

    def validate(self, torch, model, manifest: Manifest, run, tolerance: float) -> dict:
        """ORT (through ``run(feeds) -> {name: array}``) against PyTorch: the record stored in the manifest."""


class Recurrent:
    """A family rlxrt exports itself from a module with export_graph, validate_graph and the layout functions
    (mamba.py, jamba.py): the state after each fed token is a graph output. fp32 only."""

    task = "recurrent-with-states"

    def __init__(self, module):
        self.module = module

    def export(self, steps, torch, model, graph: Path, variant: str, with_hidden: bool) -> None:
        if variant != "float32":
            raise ExportError(f"{model.config.model_type} exports in fp32 only for now (asked for {variant}); "
                              "drop --dtype/--quantize")
        steps.run("export", self.module.export_graph, torch, model, graph, with_hidden)

    def layout(self, model, graph: Path, variant: str, with_hidden: bool) -> dict:
        cfg, m = model.config, self.module
        return {"dtype": "float32", "inputs": m.inputs(cfg),
                "outputs": {"logits": "logits", "hidden_states": HIDDEN if with_hidden else None},
                "kv_cache": m.kv_layout(cfg), "state": m.state_layout(cfg), "max_positions": m.max_positions(cfg)}

    def validate(self, torch, model, manifest: Manifest, run, tolerance: float) -> dict:
        return self.module.validate_graph(torch, model, run, tolerance)


FAMILIES: dict[str, Exporter] = {"attention": Attention(), "mamba": Recurrent(mamba), "jamba": Recurrent(jamba)}

OWN = {"mamba": "mamba", "falcon_mamba": "mamba", "jamba": "jamba"}
"""Model types rlxrt exports itself -> their family; every model type optimum-onnx exports with a KV cache
is ``attention``."""


def family_for(config: dict) -> Exporter:
    """The exporter of a model's ``config.json``; ExportError lists the supported model types."""
    model_type = config.get("model_type")
    if model_type in OWN:
        return FAMILIES[OWN[model_type]]
    attention = supported_model_types()
    if model_type not in attention:
        raise ExportError(
            f"unsupported architecture {model_type!r} ({', '.join(config.get('architectures') or []) or 'no class'}); "
            f"supported: {', '.join(sorted(attention + list(OWN)))}"
        )
    return FAMILIES["attention"]
