import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import rlxrt
from rlxrt import Config, ExportError, Manifest, MissingDependencyError

pytestmark = pytest.mark.export
FAMILIES = ["llama", "qwen2", "mistral", "gpt2"]


def graph(path):
    return rlxrt.compile(path, Config(cache=False, intra_op_threads=1))


def feeds(m: Manifest, ids, past, past_len):
    f = {m.inputs["input_ids"]: np.asarray(ids, np.int64)[None]}
    s = len(ids)
    if m.inputs["attention_mask"]:
        f[m.inputs["attention_mask"]] = np.ones((1, past_len + s), np.int64)
    if m.inputs["position_ids"]:
        f[m.inputs["position_ids"]] = np.arange(past_len, past_len + s, dtype=np.int64)[None]
    kv = m.kv_cache
    for i in range(kv.layers):
        pk, pv, _, _ = kv.names(i)
        f[pk] = past[2 * i] if past else np.zeros((1, kv.kv_heads, 0, kv.head_dim), kv.dtype)
        f[pv] = past[2 * i + 1] if past else np.zeros((1, kv.kv_heads, 0, kv.head_dim), kv.dtype)
    return f


def step(g, m, ids, past, past_len):
    names = [m.outputs["logits"]] + [n for i in range(m.kv_cache.layers) for n in m.kv_cache.names(i)[2:]]
    out = g.session.run(names, feeds(m, ids, past, past_len))
    return out[0][0], out[1:]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_exports_with_a_valid_manifest(exported, family):
    out = exported(family)
    src = exported.source(family)
    cfg = json.loads((src / "config.json").read_text())
    m = Manifest.load(out)
    assert m.model_type == family and m.dtype == "float32"
    assert m.vocab_size == cfg["vocab_size"]
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    heads = cfg.get("num_key_value_heads", cfg.get("n_head"))
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    n_heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    assert (m.kv_cache.layers, m.kv_cache.kv_heads, m.kv_cache.head_dim) == (layers, heads, hidden // n_heads)
    assert m.max_positions == cfg.get("max_position_embeddings", cfg.get("n_positions"))
    assert m.eos_token_ids == (1,) and m.bos_token_id == 0
    assert m.tokenizer == "tokenizer.json" and (out / "tokenizer.json").is_file()
    v = m.validation
    assert v["passed"] and v["max_abs_diff"] < 1e-3 and v["argmax_agreement"] == 1.0 and v["step_tokens"] == 4
    assert len(m.source["weights_sha256"]) == 64 and m.versions["torch"] and m.versions["optimum-onnx"]
    g = graph(out)
    assert set(m.inputs.values()) - {None} <= set(g.input_names)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_k_plus_1_step_equals_single_steps(exported, family):
    out = exported(family, graph="portable")
    m, g = Manifest.load(out), graph(out)
    prompt, new = [5, 9, 17, 3, 44, 12], [7, 100, 23, 8, 61]
    _, past = step(g, m, prompt, None, 0)
    multi, _ = step(g, m, new, past, len(prompt))
    singles, p, n = [], past, len(prompt)
    for t in new:
        logits, p = step(g, m, [t], p, n)
        singles.append(logits[0])
        n += 1
    np.testing.assert_allclose(multi, np.stack(singles), atol=1e-5)
    assert (multi.argmax(-1) == np.stack(singles).argmax(-1)).all()


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_rollback_equals_never_feeding_rejected_tokens(exported, keep):
    out = exported("qwen2", graph="portable")
    m, g = Manifest.load(out), graph(out)
    prompt, drafted, cont = [5, 9, 17, 3], [70, 71, 72, 73], [200, 201]
    _, past = step(g, m, prompt, None, 0)
    _, after = step(g, m, drafted, past, len(prompt))
    length = len(prompt) + keep
    rolled = [t[:, :, :length] for t in after]  # a view: rollback is moving the length
    got, _ = step(g, m, cont, rolled, length)
    _, clean = step(g, m, prompt + drafted[:keep], None, 0)
    want, _ = step(g, m, cont, clean, length)
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("dtype, quantize, tol", [("fp16", None, 5e-2), ("fp32", "int8", 1.0)])
def test_variants_load_and_validate(exported, dtype, quantize, tol):
    out = exported("llama", dtype=dtype, quantize=quantize, graph="portable")
    m = Manifest.load(out)
    assert m.dtype == ("float16" if dtype == "fp16" else "int8")
    assert m.kv_cache.dtype == ("float16" if dtype == "fp16" else "float32")
    assert m.validation["passed"] and 0.0 <= m.validation["argmax_agreement"] <= 1.0
    fp32 = exported("llama", graph="portable")
    logits, _ = step(graph(out), m, [5, 9, 17], None, 0)
    ref, _ = step(graph(fp32), Manifest.load(fp32), [5, 9, 17], None, 0)
    assert np.abs(logits.astype(np.float32) - ref).max() < tol


@pytest.mark.parametrize("graph", ["portable", "fused"])
def test_int8_is_smaller(exported, graph):
    def size(d):  # the graph and its external weights
        return sum(f.stat().st_size for f in d.iterdir() if f.name.startswith("model.onnx"))

    assert size(exported("llama", quantize="int8", graph=graph)) < 0.5 * size(exported("llama", graph=graph))


def test_missing_dir(tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        rlxrt.export(tmp_path / "nope", tmp_path / "out")


def test_dir_without_config(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(ExportError, match="no config.json"):
        rlxrt.export(tmp_path / "src", tmp_path / "out")


def test_unsupported_architecture_fails_before_loading(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "rwkv", "architectures": ["RwkvForCausalLM"]}))
    with pytest.raises(ExportError, match="unsupported architecture 'rwkv'.*supported: .*llama.*mamba"):
        rlxrt.export(src, tmp_path / "out")


def test_existing_out_needs_force(exported, tmp_path):
    src = exported.source("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty.*--force"):
        rlxrt.export(src, out)
    assert (out / "keep.txt").read_text() == "mine"
    rlxrt.export(src, out, force=True)
    assert Manifest.load(out).model_type == "llama" and not (out / "keep.txt").exists()


@pytest.mark.parametrize("graph", ["fused", "portable"])
def test_exported_files_keep_the_users_umask(exported, tmp_path, graph):
    """onnx writes external data as 0600: the export gives every file the mode a new file of the user gets."""
    import os

    old = os.umask(0o022)
    try:
        out = rlxrt.export(exported.source("llama"), tmp_path / graph, graph=graph, force=True).path
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_unreadable_weights(exported, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(exported.source("llama"), src)
    w = src / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ExportError, match="cannot load the weights"):
        rlxrt.export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failed_validation_leaves_nothing(exported, tmp_path):
    with pytest.raises(ExportError, match="validation failed"):
        rlxrt.export(exported.source("llama"), tmp_path / "out", atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_without_tokenizer(exported, tmp_path):
    src = exported.source("llama", seed=3, tokenizer=False)
    res = rlxrt.export(src, tmp_path / "out")
    assert res.manifest.tokenizer is None and res.manifest.validation["passed"]


def test_hub_id_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    t = time.perf_counter()
    with pytest.raises(ExportError, match="cannot be reached.*local directory"):
        rlxrt.export("some-org/some-model", tmp_path / "out")
    assert time.perf_counter() - t < 10


def test_torch_missing_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "import rlxrt\n"
            "try:\n    rlxrt.export(sys.argv[1], sys.argv[2], graph='portable')\n"
            "except rlxrt.MissingDependencyError as e:\n    print('MISSING', e)\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out")], capture_output=True,
                       text=True)
    assert "MISSING" in r.stdout and "rlxrt[export]" in r.stdout, r.stderr
    assert issubclass(MissingDependencyError, ImportError)


def test_cli_export_json(exported, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLXRT_")}
    r = subprocess.run([sys.executable, "-m", "rlxrt", "export", str(exported.source("gpt2")),
                        str(tmp_path / "o"), "--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["manifest"]["model_type"] == "gpt2" and set(data["seconds"]) >= {"load", "export", "validate"}
    for stepname in ("load", "export", "validate", "write"):
        assert stepname in r.stderr
    r2 = subprocess.run([sys.executable, "-m", "rlxrt", "export", str(exported.source("gpt2")),
                         str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert r2.returncode == 1 and "--force" in r2.stderr and "Traceback" not in r2.stderr
    r3 = subprocess.run([sys.executable, "-m", "rlxrt", "inspect", str(tmp_path / "o")], capture_output=True,
                        text=True, env=env)
    assert r3.returncode == 0 and "GPT2LMHeadModel" in r3.stdout
