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
