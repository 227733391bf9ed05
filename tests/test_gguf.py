"""`rlxrt export model.gguf OUT`: a tiny GGUF written in the test (gguf package, llama.cpp's layout) exports,
validates, generates what the Hugging Face model it came from generates, and tokenises with the GGUF's own
BOS behaviour; the manifest records the file and its sha256."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest

pytest.importorskip("gguf")

from gguf_models import write_gguf  # noqa: E402

from rlxrt.config import Config  # noqa: E402
from rlxrt.errors import ExportError  # noqa: E402

CPU = Config(providers=("cpu",), intra_op_threads=1, cache=False)


@pytest.mark.export
@pytest.mark.parametrize("add_bos", [True, False], ids=["bos", "no-bos"])
def test_gguf_export(exported, tmp_path, add_bos):
    import torch
    from transformers import AutoModelForCausalLM

    import rlxrt
    from rlxrt.sessions import PromptLookup, Session

    src = exported.source("llama", seed=5)
    gguf = write_gguf(src, tmp_path / "tiny.gguf", add_bos=add_bos)
    res = rlxrt.export(gguf, tmp_path / "out")
    m = res.manifest
    assert m.source["path_or_id"] == "tiny.gguf" and "dequantise" in res.seconds
    assert m.source["gguf_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert m.validation["passed"] and m.graph_kind == "fused"
    assert not any(str(tmp_path) in line for line in (tmp_path / "out" / "rlxrt.json").read_text().splitlines())
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<s>", "</s>", add_bos)

    session = Session(tmp_path / "out", None, CPU)
    ids = session.prompt_ids("def add(a, b):")
    assert (ids[0] == 0) == add_bos and ids.count(0) == int(add_bos)
    # the GGUF holds the source model's weights exactly (q/k permuted for llama.cpp and back): same greedy
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, min_new_tokens=20,
                           do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
    assert session.generate(ids, max_new_tokens=20, ignore_eos=True).token_ids == want
    assert Session(tmp_path / "out", PromptLookup(), CPU).generate(ids, max_new_tokens=20,
                                                                   ignore_eos=True).token_ids == want


@pytest.mark.export
def test_gguf_directory_and_errors(exported, tmp_path):
    import rlxrt

    src = exported.source("llama", seed=5)
    folder = tmp_path / "g"
    folder.mkdir()
    write_gguf(src, folder / "a.gguf", add_bos=False, chat_template="{{ messages[0]['content'] }}")
    res = rlxrt.export(folder, tmp_path / "out")  # a directory holding one GGUF
    assert res.manifest.source["path_or_id"] == "a.gguf" and res.manifest.chat is not None
    shutil.copy(folder / "a.gguf", folder / "b.gguf")
    with pytest.raises(ExportError, match="2 GGUF files"):
        rlxrt.export(folder, tmp_path / "out2")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ExportError, match="not a readable GGUF"):
        rlxrt.export(bad, tmp_path / "out3")
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


QUANT = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_0", "ffn_down": "Q4_1", "output": "Q8_0"}
"""A GGUF as llama.cpp quantises one: 4-bit projections (both kinds, mixed inside packed q/k/v and gate/up) and
an 8-bit output layer."""


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_read_as_the_gguf_package_dequantises_them(kind):
    """gguf_blocks.parse gives the values gguf.quants.dequantize gives (the ones transformers loads), and
    unpermute undoes llama.cpp's q/k row order."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    from gguf_models import _permute

    from rlxrt.exporters.gguf_blocks import parse, unpermute

    w = np.random.default_rng(1).standard_normal((24, 96)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quants.quantize(w, qtype)
    blocks = parse(kind, raw)
    want = quants.dequantize(raw, qtype)
    assert blocks.codes.shape == (24, 3, 32) and np.abs(blocks.values() - want).max() <= 1e-6 * np.abs(want).max()
    assert np.array_equal(_permute(w, 4)[unpermute(24, 4)], w)


@pytest.mark.export
def test_gguf_int4_keeps_the_files_own_blocks(exported, tmp_path, monkeypatch):
    """--quantize int4 on a Q4_0/Q4_1/Q8_0 GGUF keeps the file's blocks: the int4 graph computes the model the
    GGUF holds to float32 tolerance (quantising its dequantised weights again does not), greedy equals the fp32
    export of the same file, speculation over it is exact, and the manifest accounts for every weight; with
    int8 activations the Q8_0 layer is 8-bit MatMulNBits."""
    import numpy as np
    import onnx

    import rlxrt
    from rlxrt.exporters import gguf_blocks
    from rlxrt.exporters.validate import TOLERANCE
    from rlxrt.sessions import PromptLookup, Session

    gguf = write_gguf(exported.source("llama", seed=5), tmp_path / "q.gguf", add_bos=False, quant=QUANT)
    fp32 = rlxrt.export(gguf, tmp_path / "fp32").manifest
    m = rlxrt.export(gguf, tmp_path / "q4", quantize="int4").manifest
    assert m.quantization["gguf"] == {"weights": {"Q4_0": 6, "Q4_1": 8, "float32": 1}, "quantised_here": []}
    fp32_bound = m.validation["tolerance"] * TOLERANCE["float32"] / TOLERANCE["int4"]
    assert m.validation["passed"] and m.validation["max_abs_diff"] <= fp32_bound
    prompt = "def add(a, b):"
    want = Session(tmp_path / "fp32", None, CPU).generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
    assert Session(tmp_path / "q4", None, CPU).generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == want
    g = Session(tmp_path / "q4", PromptLookup(), CPU, k=3).generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert g.token_ids == want and fp32.validation["passed"]

    i8 = rlxrt.export(gguf, tmp_path / "q4i8", quantize="int4", int4_compute="int8").manifest
    assert i8.quantization["gguf"]["weights"] == {"Q4_0": 6, "Q4_1": 8, "Q8_0": 1} and i8.validation["passed"]
    bits = {a.i for n in onnx.load(str(tmp_path / "q4i8" / "model.onnx")).graph.node if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name == "bits"}
    assert bits == {4, 8}

    monkeypatch.setattr(gguf_blocks, "matched", lambda *a: {})  # control: the dequantised weights quantised again
    again = rlxrt.export(gguf, tmp_path / "again", quantize="int4", atol=10).manifest
    assert "gguf" not in again.quantization and again.validation["max_abs_diff"] > 10 * m.validation["max_abs_diff"]
    assert not np.isclose(again.validation["max_abs_diff"], m.validation["max_abs_diff"])
