"""Rebuild the shipped pair as fused graphs from the exact fp32 weights of their portable exports.

The training checkpoints are not in the repository (only their fp16 copies in ``weights/``), and the MTP
head records its target's weights hash, so the fused graphs are built from the weights the shipped
portable graphs already hold, bit for bit: the named initializers by name, and each anonymous MatMul
weight matched to its Linear by nearest distance to the fp16 copy (the match must be unambiguous).
The result is validated against the portable graph it replaces (same weights, so within float error).
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from rlxrt.errors import ExportError
from rlxrt.manifest import Manifest

from ..deps import versions
from ..export import GRAPH
from ..fused import TASK, build_graph, fused_layout
from ..safetensors_np import read_weights
from ..source import read_config
from ..validate import feeds_for, validate
from .build import ASSETS, WEIGHTS


def weights_from_portable(graph: Path, checkpoint: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named fp32 weights taken from the portable graph ``graph``; ``checkpoint`` (the fp16 copy, as
    float32) only says which anonymous initializer is which Linear."""
    import onnx
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(graph)).graph.initializer}
    out = {name: inits[name] for name in checkpoint if name in inits}
    free = {n: a for n, a in inits.items() if n not in out and a.ndim == 2}
    for name, w in checkpoint.items():
        if name in out or w.ndim != 2 or name == "lm_head.weight":
            continue
        want = w.T
        dist = sorted((float(np.abs(a - want).max()), n) for n, a in free.items() if a.shape == want.shape)
        if not dist or dist[0][0] > 1e-2 * max(1.0, float(np.abs(want).max())) or \
                (len(dist) > 1 and dist[1][0] <= 10 * dist[0][0]):
            raise ExportError(f"cannot match {name} to one initializer of {graph} (distances {dist[:2]})")
        out[name] = free.pop(dist[0][1]).T
    return out


def fuse_shipped(runner, assets: Path = ASSETS, checkpoints: Path = WEIGHTS) -> dict[str, dict]:
    """Replace ``assets/{target,draft}`` with fused graphs of the same weights; returns their validation."""
    records = {}
    for role in ("target", "draft"):
        portable = assets / role
        old = Manifest.load(portable)
        if old.graph_kind == "fused":
            records[role] = old.validation
            continue
        weights = weights_from_portable(portable / old.graph, read_weights(checkpoints / role))
        work = assets / f".{role}.fused"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        with_hidden = bool(old.outputs.get("hidden_states"))
        spec = build_graph(read_config(checkpoints / role), weights, work / GRAPH, capacity=old.max_positions,
                           with_hidden=with_hidden)
        for f in portable.iterdir():
            if not f.name.startswith(("model.onnx", "rlxrt.json")):
                shutil.copy2(f, work / f.name)
        manifest = replace(old, graph=GRAPH, **fused_layout(spec, with_hidden), versions=versions(),
                           source={**old.source, "task": TASK, "built_from": "the portable export's own weights"})
        ids = np.random.default_rng(0).integers(0, old.vocab_size, size=(1, 12), dtype=np.int64)
        run_old = runner(portable / old.graph)
        ref = run_old(feeds_for(old, ids, None, 0))[old.outputs["logits"]]
        record = validate(runner(work / GRAPH), manifest, ids, ref, 8, 1e-4)
        if not record["passed"]:
            raise ExportError(f"the fused {role} differs from the portable one: {record}")
        records[role] = {**record, "against": "the portable graph of the same weights"}
        replace(manifest, validation=records[role]).write(work)
        shutil.rmtree(portable)
        work.rename(portable)
    return records
