import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import make_mlp_onnx
from rlxrt import Config, ModelFormatError, ProviderError, compile
from rlxrt.backends import ProviderStatus, Registry


def cfg(cache_dir, **kw):
    kw.setdefault("intra_op_threads", 1)
    return Config(cache_dir=str(cache_dir), **kw)


def run(graph, x):
    return graph.session.run(["y"], {"x": x})[0]


def test_miss_then_hit_same_results(mlp, cache_dir):
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    g1 = compile(mlp, cfg(cache_dir))
    assert g1.cache == "miss" and g1.providers[0] == "cpu" and g1.fallbacks == []
    assert (g1.cache_path / "model.onnx").is_file()
    g2 = compile(mlp, cfg(cache_dir))
    assert g2.cache == "hit" and g2.cache_path == g1.cache_path
    np.testing.assert_allclose(run(g1, x), run(g2, x), rtol=1e-6)
    assert g1.input_names == ["x"] and g1.output_names == ["y"]
    assert g1.inputs[0].shape == ("batch", 16) and g1.inputs[0].dtype == "tensor(float)"


def test_edit_misses_cache(tmp_path, cache_dir):
    path = make_mlp_onnx(tmp_path / "m" / "model.onnx", seed=0)
    g1 = compile(path, cfg(cache_dir))
    make_mlp_onnx(path, seed=1)  # same file name, new weights
    g2 = compile(path, cfg(cache_dir))
    assert g2.cache == "miss" and g2.cache_path != g1.cache_path
    x = np.ones((1, 16), np.float32)
    assert not np.allclose(run(g1, x), run(g2, x))


def test_external_data_is_part_of_the_key(tmp_path, cache_dir):
    path = make_mlp_onnx(tmp_path / "m" / "model.onnx", seed=0, external=True)
    g1 = compile(path, cfg(cache_dir))
    data = path.parent / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF  # change one weight byte, graph file untouched
    data.write_bytes(bytes(raw))
    g2 = compile(path, cfg(cache_dir))
    assert g1.cache == "miss" and g2.cache == "miss" and g2.cache_path != g1.cache_path


def test_option_change_misses_cache(mlp, cache_dir):
    a = compile(mlp, cfg(cache_dir, graph_optimization="all"))
    b = compile(mlp, cfg(cache_dir, graph_optimization="basic"))
    assert b.cache == "miss" and a.cache_path != b.cache_path
    c = compile(mlp, cfg(cache_dir, graph_optimization="basic", intra_op_threads=2))
    assert c.cache == "hit"  # threads do not change the optimised graph


def test_ort_version_is_part_of_the_key(mlp, cache_dir, monkeypatch):
    import onnxruntime

    a = compile(mlp, cfg(cache_dir))
    monkeypatch.setattr(onnxruntime, "__version__", "999.0")
    b = compile(mlp, cfg(cache_dir))
    assert b.cache == "miss" and b.cache_path != a.cache_path


def test_cache_off(mlp, cache_dir):
    g = compile(mlp, cfg(cache_dir, cache=False))
    assert g.cache.startswith("off") and g.cache_path is None and not (cache_dir / "graphs").exists()


def test_damaged_cache_entry_is_rebuilt(mlp, cache_dir):
    g1 = compile(mlp, cfg(cache_dir))
    (g1.cache_path / "model.onnx").write_bytes(b"garbage")
    g2 = compile(mlp, cfg(cache_dir))
    assert g2.cache == "miss"
    assert compile(mlp, cfg(cache_dir)).cache == "hit"


def test_model_directory_with_model_onnx(mlp, cache_dir):
    g = compile(mlp.parent, cfg(cache_dir))
    assert g.path == mlp and g.manifest is None


def test_two_processes_compiling_at_once(mlp, cache_dir, tmp_path):
    script = tmp_path / "c.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from rlxrt import Config, compile
        g = compile({str(mlp)!r}, Config(cache_dir={str(cache_dir)!r}, intra_op_threads=1))
        print(json.dumps({{"cache": g.cache, "path": str(g.cache_path)}}))
    """))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({o["path"] for o in outs}) == 1
    entries = [p for p in (cache_dir / "graphs").iterdir()]
    assert [p.name for p in entries] == [Path(outs[0]["path"]).name]  # no temp dirs left behind
    g = compile(mlp, cfg(cache_dir))
    assert g.cache == "hit"
    np.testing.assert_allclose(run(g, np.ones((1, 16), np.float32)),
                               run(compile(mlp, cfg(cache_dir, cache=False)), np.ones((1, 16), np.float32)),
                               rtol=1e-6)


def test_missing_path(tmp_path, cache_dir):
    with pytest.raises(ModelFormatError, match="does not exist.*nope.onnx.*rlxrt export"):
        compile(tmp_path / "nope.onnx", cfg(cache_dir))


def test_empty_directory(tmp_path, cache_dir):
    with pytest.raises(ModelFormatError, match="neither rlxrt.json nor model.onnx"):
        compile(tmp_path, cfg(cache_dir))


def test_not_onnx(tmp_path, cache_dir):
    p = tmp_path / "model.onnx"
    p.write_text("this is a text file, not a model\n" * 10)
    with pytest.raises(ModelFormatError, match="not a readable ONNX model|holds no ONNX graph"):
        compile(p, cfg(cache_dir))


def test_truncated(mlp, tmp_path, cache_dir):
    raw = mlp.read_bytes()
    p = tmp_path / "cut.onnx"
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ModelFormatError, match="cut.onnx"):
        compile(p, cfg(cache_dir))


def test_missing_external_data(tmp_path, cache_dir):
    path = make_mlp_onnx(tmp_path / "m" / "model.onnx", external=True)
    (path.parent / "model.onnx.data").unlink()
    with pytest.raises(ModelFormatError, match="model.onnx.data.*missing"):
        compile(path, cfg(cache_dir))


def test_unknown_provider_in_config(mlp):
    from rlxrt import ConfigError

    with pytest.raises(ConfigError, match="unknown provider 'gpu'"):
        compile(mlp, Config(providers=("gpu",)))


class LyingRegistry(Registry):
    """Claims CUDA passed its probe; the real ORT then silently runs the session on CPU."""

    def status(self, name):
        if name == "cuda":
            return ProviderStatus("cuda", "CUDAExecutionProvider", True, "", "")
        return super().status(name)


def test_silent_fallback_at_compile_is_recorded(mlp, cache_dir):
    g = compile(mlp, cfg(cache_dir, providers=("cuda", "cpu"), cache=False), registry=LyingRegistry())
    assert g.providers == ["cpu"] and any("silently" in f for f in g.fallbacks)
    with pytest.raises(ProviderError, match="silently runs on cpu.*strict"):
        compile(mlp, cfg(cache_dir, providers=("cuda", "cpu"), cache=False, strict=True),
                registry=LyingRegistry())


def test_in_place_rewrite_keeping_size_inode_and_mtime_is_seen(tmp_path, cache_dir):
    """Only the ctime betrays this rewrite (it cannot be set back); the stale graph is never served."""
    import os

    path = make_mlp_onnx(tmp_path / "m" / "model.onnx", seed=0)
    g1 = compile(path, cfg(cache_dir))
    before = os.stat(path)
    new = make_mlp_onnx(tmp_path / "other" / "model.onnx", seed=1).read_bytes()
    assert len(new) == before.st_size
    with open(path, "r+b") as fh:  # same inode
        fh.write(new)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (before.st_size, before.st_ino, before.st_mtime_ns)
    g2 = compile(path, cfg(cache_dir))
    assert g2.cache == "miss" and g2.cache_path != g1.cache_path
    x = np.ones((1, 16), np.float32)
    np.testing.assert_allclose(run(g2, x), run(compile(path, cfg(cache_dir, cache=False)), x), rtol=1e-6)
    assert not np.allclose(run(g1, x), run(g2, x))


def test_entry_that_lost_its_graph_is_rebuilt(mlp, cache_dir):
    g1 = compile(mlp, cfg(cache_dir))
    (g1.cache_path / "model.onnx").unlink()
    g2 = compile(mlp, cfg(cache_dir))
    assert g2.cache == "miss" and (g2.cache_path / "model.onnx").is_file()
    assert compile(mlp, cfg(cache_dir)).cache == "hit"


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_unusable_cache_dir_compiles_uncached(mlp, tmp_path, monkeypatch, caplog, where):
    x = np.ones((2, 16), np.float32)
    want = run(compile(mlp, cfg(tmp_path / "c0", cache=False)), x)
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    cache = {"a file": blocker, "under a file": blocker / "sub", "read-only": tmp_path / "ro"}[where]
    if where == "read-only":  # root ignores permission bits: fail the way a read-only directory does
        import tempfile

        def refuse(*a, **kw):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with caplog.at_level("WARNING", logger="rlxrt"):
        g = compile(mlp, cfg(cache))
    assert g.cache.startswith("off: cache dir") and g.cache_path is None
    assert "without the cache" in caplog.text
    np.testing.assert_allclose(run(g, x), want, rtol=1e-6)


def test_ort_failing_to_write_into_the_cache_compiles_uncached(mlp, tmp_path, monkeypatch, caplog):
    """ORT itself writes the optimised graph: when that fails (disk full …) the model is not to blame."""
    import sys as _sys

    comp = _sys.modules["rlxrt.backends.compile"]

    def fail(*a, **kw):
        raise ModelFormatError("onnxruntime cannot load 'x': Failed to write optimized model")
    monkeypatch.setattr(comp, "_compile_into_cache", fail)
    with caplog.at_level("WARNING", logger="rlxrt"):
        g = compile(mlp, cfg(tmp_path / "c"))
    assert g.cache.startswith("off: cache dir") and "could not write" in g.cache
    x = np.ones((1, 16), np.float32)
    np.testing.assert_allclose(run(g, x), run(compile(mlp, cfg(tmp_path / "c2", cache=False)), x), rtol=1e-6)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(mlp.read_bytes()[:-40])  # and a bad model is still a bad model
    with pytest.raises(ModelFormatError):
        compile(bad, cfg(tmp_path / "c"))


def test_entry_with_a_truncated_file_is_rebuilt(mlp, cache_dir):
    g1 = compile(mlp, cfg(cache_dir))
    data = g1.cache_path / "model.onnx"
    data.write_bytes(data.read_bytes()[:-10])
    assert compile(mlp, cfg(cache_dir)).cache == "miss"
    assert compile(mlp, cfg(cache_dir)).cache == "hit"
