"""The fused graph (exporters/fused.py) driven by its IOBinding model (sessions/fused.py): against PyTorch,
against the portable graph, under speculation, at its capacity, and exported without torch."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import rlxrt
from rlxrt import Config, ExportError, GenerationError, Manifest, compile
from rlxrt.sampling import SamplingParams
from rlxrt.sessions import DraftModel, PromptLookup, Session, decoder_for
from rlxrt.sessions.fused import FusedKVModel

from lossless import assert_first_two_tokens_follow, two_token_marginals

pytestmark = pytest.mark.export
CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
FAMILIES = ["llama", "qwen2", "mistral", "qwen3"]


def torch_logits(exported, family, ids, seed=0):
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(exported.source(family, seed=seed))).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].numpy(), out.hidden_states[-1][0].numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_graph_matches_pytorch_through_rollbacks(exported, family):
    out = exported(family, with_hidden=True)
    m = Manifest.load(out)
    assert m.graph_kind == "fused" and m.kv_cache.capacity == m.max_positions and m.validation["passed"]
    assert m.inputs["attention_mask"] is None and m.inputs["position_ids"] is None
    model = decoder_for(compile(out, CFG))
    assert isinstance(model, FusedKVModel)
    model.fetch_hidden()
    rng = np.random.default_rng(1)
    ids = rng.integers(3, m.vocab_size, 24).tolist()
    ref, ref_hidden = torch_logits(exported, family, ids)
    got = model.forward(ids[:10])  # prefill, every row
    np.testing.assert_allclose(got, ref[:10], atol=1e-4)
    np.testing.assert_allclose(model.hidden, ref_hidden[:10], atol=1e-4)
    model.forward(rng.integers(3, m.vocab_size, 5))  # 5 drafted tokens, all rejected ...
    model.commit(10)  # ... rollback is moving the length
    last = model.forward(ids[10:15], rows=2)  # a verify pass: only the rows asked for
    assert last.shape == (2, m.vocab_size)
    np.testing.assert_allclose(last, ref[13:15], atol=1e-4)
    model.commit(12)  # keep two of them
    np.testing.assert_allclose(model.forward(ids[12:24]), ref[12:24], atol=1e-4)
    np.testing.assert_allclose(model.hidden, ref_hidden[12:24], atol=1e-4)


def test_fused_graph_is_small(exported):
    import onnx

    out = exported("llama")
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    layers = Manifest.load(out).kv_cache.layers
    assert ops.count("GroupQueryAttention") == layers and ops.count("SkipSimplifiedLayerNormalization") == 2 * layers
    assert len(ops) <= 13 * layers + 12
    portable = onnx.load(str(exported("llama", graph="portable") / "model.onnx"), load_external_data=False)
    assert len(ops) * 4 < len(portable.graph.node)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_and_portable_graphs_generate_the_same(exported, family):
    fused = Session(exported(family), None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    portable = Session(exported(family, graph="portable"), None, CFG).generate(PROMPT, max_new_tokens=40,
                                                                               ignore_eos=True)
    assert fused.token_ids == portable.token_ids


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("draft", ["fused self", "fused other", "portable other", "lookup"])
def test_greedy_speculation_on_fused_graphs_is_exact(exported, k, draft):
    """Plain decoding argmaxes the full logits; the speculative target verifies through its greedy head."""
    plain = Session(exported("mistral"), None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    spec = {"fused self": lambda: DraftModel(exported("mistral"), CFG),
            "fused other": lambda: DraftModel(exported("mistral", seed=1), CFG),
            "portable other": lambda: DraftModel(exported("mistral", seed=1, graph="portable"), CFG),
            "lookup": PromptLookup}[draft]()
    target = exported("mistral", greedy_head=True)
    g = Session(target, spec, CFG, k=k).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert g.token_ids == plain.token_ids
    if draft == "fused self":
        assert g.stats.acceptance_rate == 1.0
    if draft.endswith("other"):
        assert g.stats.rounds > 40 // (k + 1)  # rejections happened: rollbacks were exercised


def test_sampled_output_over_a_fused_pair_has_the_targets_distribution(exported):
    target, draft = exported("qwen2"), exported("qwen2", seed=1)
    prompt = [5, 17, 42, 9]
    p1, p2 = two_token_marginals(decoder_for(compile(target, CFG)), prompt, SamplingParams(temperature=1.0))
    session = Session(target, DraftModel(draft, CFG), CFG, k=2)
    assert_first_two_tokens_follow(session, prompt, p1, p2, draws=3000)


def test_a_request_up_to_the_capacity_and_a_clear_error_past_it(exported, tmp_path):
    out = tmp_path / "small"
    rlxrt.export(exported.source("llama"), out, max_context=48)
    m = Manifest.load(out)
    assert m.kv_cache.capacity == 48 and m.max_positions == 48
    s = Session(out, DraftModel(out, CFG), CFG, k=4)
    prompt = list(range(3, 33))
    g = s.generate(prompt, max_new_tokens=100, ignore_eos=True)
    assert g.finish_reason == "length" and len(prompt) + len(g.token_ids) == 48
    plain = Session(out, None, CFG).generate(prompt, max_new_tokens=100, ignore_eos=True)
    assert plain.token_ids == g.token_ids
    with pytest.raises(GenerationError, match="48"):
        s.generate(list(range(3, 51)), max_new_tokens=1)
    model = decoder_for(compile(out, CFG))
    model.forward(list(range(3, 43)))
    with pytest.raises(GenerationError, match="KV capacity"):
        model.forward(list(range(3, 12)))
    assert s.generate(prompt, max_new_tokens=100, ignore_eos=True).token_ids == g.token_ids


@pytest.mark.parametrize("kwargs, words", [
    ({"graph": "fused", "family": "gpt2"}, "covers llama"),
    ({"graph": "fused", "family": "llama", "hidden": 32}, "multiple of 16"),
    ({"graph": "fused", "family": "llama", "quantize": "int8", "dtype": "fp16"}, "starts from fp32 weights"),
    ({"graph": "portable", "family": "llama", "max_context": 64}, "--max-context"),
    ({"family": "llama", "max_context": 10 ** 6}, "outside 1..256"),
    ({"graph": "tiny", "family": "llama"}, "not a graph kind"),
])
def test_bad_fused_exports(exported, tmp_path, kwargs, words):
    family = kwargs.pop("family")
    hidden = kwargs.pop("hidden", 64)
    with pytest.raises(ExportError, match=words):
        rlxrt.export(exported.source(family, hidden=hidden), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_fused_export_needs_no_torch(exported, tmp_path):
    """torch blocked in a fresh interpreter: the fused export works, says it was not validated, and runs."""
    src, out = exported.source("llama"), tmp_path / "out"
    code = ("import sys, json; sys.modules['torch'] = None\n"
            "import rlxrt\n"
            "r = rlxrt.export(sys.argv[1], sys.argv[2])\n"
            "from rlxrt.sessions import Session\n"
            "g = Session(sys.argv[2], None, rlxrt.Config(intra_op_threads=1, cache=False)).generate([5, 6, 7], "
            "max_new_tokens=8, ignore_eos=True)\n"
            "print(json.dumps({'v': r.manifest.validation, 'ids': g.token_ids, 'torch': 'torch' in sys.modules "
            "and sys.modules['torch'] is not None}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLXRT_")}
    r = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["v"] == {"skipped": True, "reason": "torch/transformers not installed"} and not res["torch"]
    want = Session(exported("llama"), None, CFG).generate([5, 6, 7], max_new_tokens=8, ignore_eos=True)
    assert res["ids"] == want.token_ids


def test_int4_loads_stays_close_and_speculates_exactly(exported, tmp_path):
    """--quantize int4 (MatMulNBits): recorded in the manifest, close to the fp32 graph on a realistically
    initialised model, and speculation is exact relative to the quantised graph."""
    src = exported.source("llama", seed=4, init=0.02)
    fp32, q4 = tmp_path / "fp32", tmp_path / "q4"
    rlxrt.export(src, fp32)
    res = rlxrt.export(src, q4, quantize="int4")
    m = res.manifest
    assert m.dtype == "int4" and m.graph_kind == "fused" and m.validation["passed"]
    assert m.quantization["method"] == "MatMulNBits" and m.quantization["accuracy_level"] == 0  # exact
    size = lambda d: sum(f.stat().st_size for f in d.iterdir())  # noqa: E731
    assert size(q4) < size(fp32)
    ids = list(range(3, 40))
    a = decoder_for(compile(fp32, CFG)).forward(ids)
    b = decoder_for(compile(q4, CFG)).forward(ids)
    assert np.abs(a - b).max() < 0.1 * max(1.0, np.abs(a).max())
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.7
    plain = Session(q4, None, CFG).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids
    for spec in (DraftModel(q4, CFG), PromptLookup(), DraftModel(fp32, CFG)):
        assert Session(q4, spec, CFG, k=3).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids == plain


def test_int4_with_int8_compute_decodes_plainly_and_drafts_but_is_never_verified_on_ort(exported, tmp_path):
    """--int4-compute int8 (accuracy level 4): recorded with its int8 activations; plain decoding works, a
    Session over ONNX Runtime's kernels refuses any speculator over it with a typed error (and the process goes
    on), and as a DRAFT for an fp32 target it keeps speculation exact (a draft's numbers do not touch
    exactness). Over rlxrt's kernels it speculates exactly: tests/test_cpu_kernels.py."""
    src = exported.source("llama", seed=4, init=0.02)
    fast = tmp_path / "q4i8"
    m = rlxrt.export(src, fast, quantize="int4", int4_compute="int8").manifest
    assert m.quantization["accuracy_level"] == 4 and m.quantization["activations"].startswith("int8")
    import onnx

    levels = {a.i for n in onnx.load(str(fast / "model.onnx")).graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}
    assert len(Session(fast, None, CFG).generate(PROMPT, max_new_tokens=12, ignore_eos=True).token_ids) == 12
    from rlxrt.app.cli import main  # distill writes its text on such a graph, decoding plainly

    prompts, corpus = tmp_path / "prompts.json", tmp_path / "corpus.json"
    prompts.write_text(json.dumps([PROMPT]))
    assert main(["distill", str(fast), "--prompts", str(prompts), "--out", str(corpus), "--max-new-tokens", "8",
                 "--temperatures", "0", "--threads", "1", "--quiet"]) == 0
    assert json.loads(corpus.read_text()) == [PROMPT + Session(fast, None, CFG).generate(PROMPT, max_new_tokens=8).text]
    on_ort = Config(intra_op_threads=1, cache=False, cpu_kernels="ort")  # rlxrt's kernels: test_cpu_kernels.py
    for spec in (PromptLookup(), DraftModel(fast, on_ort)):
        with pytest.raises(GenerationError, match="int8 activations.*cpu_kernels = rlxrt.*--int4-compute fp32"):
            Session(fast, spec, on_ort)
    target = exported("llama", seed=4, init=0.02)
    plain = Session(target, None, CFG).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids
    g = Session(target, DraftModel(fast, CFG), CFG, k=3).generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    assert g.token_ids == plain and g.stats.drafted > 0
    with pytest.raises(ExportError, match="int8 only with quantize int4"):
        rlxrt.export(src, tmp_path / "bad", int4_compute="int8")


def test_an_int8_fused_graph_drafts_exactly_and_is_verified_only_on_rlxrts_kernels(exported, tmp_path):
    """--quantize int8 on a Llama-style model: a fused graph of 8-bit blocks (zero point 128) computed with int8
    activations, validated, a quarter of the float32 weights' bytes. As a draft for the float32 target it keeps
    greedy speculation equal to plain greedy on both kernel sets; as a target it speculates exactly on rlxrt's
    kernels (rows_exact) and is refused a speculator on ONNX Runtime's, with the fix named."""
    import onnx

    src = exported.source("llama", seed=4, init=0.02)
    q8 = tmp_path / "q8"
    m = rlxrt.export(src, q8, quantize="int8").manifest
    assert m.graph_kind == "fused" and m.dtype == "int8" and m.validation["passed"]
    assert m.quantization["bits"] == 8 and m.quantization["accuracy_level"] == 4
    nodes = [n for n in onnx.load(str(q8 / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    assert nodes and {a.i for n in nodes for a in n.attribute if a.name == "bits"} == {8}
    fp32 = exported("llama", seed=4, init=0.02)
    size = lambda d: sum(f.stat().st_size for f in d.iterdir() if f.name.startswith("model.onnx"))
    assert size(q8) < 0.45 * size(fp32)
    plain = Session(fp32, None, CFG).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids
    for mode in ("ort", "rlxrt"):
        cfg = Config(intra_op_threads=1, cache=False, cpu_kernels=mode)
        for k in (1, 3, 8):
            got = Session(fp32, DraftModel(q8, cfg), cfg, k=k).generate(PROMPT, max_new_tokens=30, ignore_eos=True)
            assert got.token_ids == plain and got.stats.accepted > 0, (mode, k)
    on_rlxrt = Config(intra_op_threads=1, cache=False, cpu_kernels="rlxrt")
    own = Session(q8, None, on_rlxrt).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids
    for spec in (PromptLookup(), DraftModel(fp32, on_rlxrt)):
        assert Session(q8, spec, on_rlxrt, k=3).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids == own
    with pytest.raises(GenerationError, match="int8 activations.*cpu_kernels = rlxrt.*--quantize int4"):
        Session(q8, PromptLookup(), Config(intra_op_threads=1, cache=False, cpu_kernels="ort"))
    portable = rlxrt.export(src, tmp_path / "p8", quantize="int8", graph="portable").manifest
    assert portable.graph_kind == "portable" and portable.quantization["method"] == "quantize_dynamic"
    assert "over all rows" in portable.quantization["activations"]
    for mode in ("ort", "rlxrt"):  # one activation scale over all rows: no kernel set makes rows alike
        with pytest.raises(GenerationError, match="quantises its activations dynamically.*fused graph"):
            Session(tmp_path / "p8", PromptLookup(), Config(intra_op_threads=1, cache=False, cpu_kernels=mode))


@pytest.mark.parametrize("kwargs, words", [({"quantize": "int4", "graph": "portable"}, "fused graph only"),
                                           ({"quantize": "int3"}, "int8, int4")])
def test_bad_int4_exports(exported, tmp_path, kwargs, words):
    with pytest.raises(ExportError, match=words):
        rlxrt.export(exported.source("llama"), tmp_path / "out", **kwargs)


def test_fp16_fused_graph(exported, tmp_path):
    """--dtype fp16 --graph fused: weights, compute and the KV buffers in float16 (what GroupQueryAttention on
    CUDA needs), logits and hidden states handed out as float32; validated, close, and exact under speculation."""
    out = tmp_path / "fp16"
    m = rlxrt.export(exported.source("llama"), out, graph="fused", dtype="fp16", with_hidden_states=True).manifest
    assert m.dtype == "float16" and m.kv_cache.dtype == "float16" and m.validation["passed"]
    model = decoder_for(compile(out, CFG))
    model.fetch_hidden()
    ref = decoder_for(compile(exported("llama"), CFG)).forward(list(range(3, 20)))
    got = model.forward(list(range(3, 20)))
    assert got.dtype == np.float32 and model.hidden.dtype == np.float32
    assert np.abs(got - ref).max() < 3e-2 * max(1.0, np.abs(ref).max())
    plain = Session(out, None, CFG).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids
    for spec in (DraftModel(out, CFG), PromptLookup(), DraftModel(exported("llama", seed=1), CFG)):
        assert Session(out, spec, CFG, k=3).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids == plain


def test_what_the_builder_reads_from_a_config():
    """Pure checks of exporters/fused.py's config reading (no weights): rope from transformers 4 and 5
    configs, sliding windows per layer as transformers applies them, and what falls back to portable."""
    from rlxrt.exporters.export import _graph_kind
    from rlxrt.exporters.fused import Spec, _rope, unsupported

    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256}
    assert _rope({**base, "rope_theta": 5e5}) == (5e5, None)
    v5 = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    assert _rope(v5)[0] == 5e5 and _rope(v5)[1]["rope_type"] == "llama3"
    yarn = {**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert "yarn" in unsupported(yarn) and _graph_kind(None, yarn, "float32", None) == "portable"
    assert "hidden_act" in unsupported({**base, "hidden_act": "gelu"})
    assert unsupported(base) is None and _graph_kind(None, base, "float32", None) == "fused"
    qwen = {**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    assert Spec(qwen, 64).windows == [-1, 8]
    assert Spec({**qwen, "use_sliding_window": False}, 64).windows == [-1, -1]
    assert Spec({**base, "model_type": "mistral"}, 64).windows == [-1, -1]  # 4096 >= the buffer: no window
    assert Spec({**base, "model_type": "mistral", "sliding_window": 16}, 64).windows == [16, 16]
    assert Spec({**base, "attention_bias": True}, 64).o_bias and not Spec(qwen, 64).o_bias


def test_sliding_window_matches_pytorch(tmp_path):
    """A mistral whose window (6) is shorter than the sequence: ORT's local window equals transformers'."""
    import torch
    import transformers as tf

    cfg = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, sliding_window=6, vocab_size=120,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).eval()
    model.save_pretrained(str(tmp_path / "src"))
    out = tmp_path / "out"
    m = rlxrt.export(tmp_path / "src", out).manifest  # validated against PyTorch too
    assert m.graph_kind == "fused" and m.validation["passed"]
    ids = np.random.default_rng(0).integers(0, 120, 20).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    fused = decoder_for(compile(out, CFG))
    # copies: a fused model hands out its own logits buffer, valid until its next call
    got = np.concatenate([fused.forward(ids[:9]).copy(), fused.forward(ids[9:14]).copy(), fused.forward(ids[14:])])
    np.testing.assert_allclose(got, ref, atol=1e-4)
