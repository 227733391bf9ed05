"""Shared fixtures. Tiers: pure functions; tiny graphs built with onnx.helper;
real exported random-init models (``export`` marker); the shipped pair."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def make_mlp_onnx(path: Path, *, seed: int = 0, hidden: int = 64, external: bool = False) -> Path:
    """A small float MLP graph (MatMul/Add/Relu/MatMul/Add) with real weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((16, hidden)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((hidden, 8)).astype(np.float32), "w2")
    b2 = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["y0"]),
        helper.make_node("Add", ["y0", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], [w1, b1, w2, b2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=0)
    else:
        onnx.save(model, str(path))
    return path


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a copy of ``src``, or for weights (over 1 MiB) a hard link to it: a regular file of its own
    directory, as a model directory must hold (a symbolic link to a file outside it is refused). A test must
    never write into a linked file: it is the source's too."""
    import shutil

    if src.stat().st_size > 1 << 20:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system
            pass
    shutil.copy2(src, dst)


@pytest.fixture
def mlp(tmp_path: Path) -> Path:
    return make_mlp_onnx(tmp_path / "mlp" / "model.onnx")


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _clean_rlxrt_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Tests never see the developer's RLXRT_* variables or rlxrt.toml."""
    for name in list(os.environ):
        if name.startswith("RLXRT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RLXRT_CACHE_DIR", str(tmp_path / "default-cache"))


class _Exports:
    """Builds and exports tiny random-init HF models once per test session."""

    def __init__(self, root: Path):
        self.root = root
        self.done: dict[tuple, Path] = {}

    def source(self, family: str, seed: int = 0, **kw) -> Path:
        from hf_models import make_model

        key = ("src", family, seed, tuple(sorted(kw.items())))
        if key not in self.done:
            path = self.root / f"src-{family}-{seed}-{len(self.done)}"
            make_model(family, path, seed=seed, **kw)
            self.done[key] = path
        return self.done[key]

    def __call__(self, family: str, seed: int = 0, dtype: str = "fp32", quantize: str | None = None,
                 with_hidden: bool = False, graph: str | None = None, greedy_head: bool | None = None,
                 greedy_candidates: int | None = None, **kw) -> Path:
        """The export of a random-init ``family`` model; ``graph`` None is rlxrt's default (fused for llama,
        qwen2 and mistral in fp32 with a head size that is a multiple of 16, else portable); ``greedy_head``
        None is the default too (off for these tiny vocabularies)."""
        import rlxrt

        key = ("onnx", family, seed, dtype, quantize, with_hidden, graph, greedy_head, greedy_candidates,
               tuple(sorted(kw.items())))
        if key not in self.done:
            src = self.source(family, seed, **kw)
            out = self.root / f"onnx-{family}-{seed}-{dtype}-{quantize}-{graph}-{len(self.done)}"
            rlxrt.export(src, out, dtype=dtype, quantize=quantize, with_hidden_states=with_hidden, graph=graph,
                         greedy_head=greedy_head, greedy_candidates=greedy_candidates)
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> _Exports:
    pytest.importorskip("torch", reason="needs rlxrt[export]")
    pytest.importorskip("optimum.exporters.onnx", reason="needs rlxrt[export]")
    return _Exports(tmp_path_factory.mktemp("exports"))
