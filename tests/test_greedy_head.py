"""The greedy head (exporters/greedy_head.py): the argmax of the logits through int8 candidates, exact.

Tiers: the bound in NumPy; the head alone as a small ONNX graph, through both of its paths (rows the bound
certifies, rows it sends to the full Gemm); exported fused models through rollbacks; the export switch."""
import numpy as np
import onnxruntime as ort
import pytest

from rlxrt import Config, ExportError, Manifest, compile
from rlxrt.exporters.fused import Builder, Spec
from rlxrt.exporters.greedy_head import MIN_SIZE, add, int8_rows
from rlxrt.exporters.validate import ids_wrong
from rlxrt.sessions import DraftModel, Session, decoder_for

CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def quantise_like_ort(h: np.ndarray) -> np.ndarray:
    """DynamicQuantizeLinear's round trip (per tensor, uint8, the range stretched to hold 0)."""
    lo, hi = min(float(h.min()), 0.0), max(float(h.max()), 0.0)
    scale = np.float32((hi - lo) / 255)
    zero = np.clip(np.rint(-lo / scale), 0, 255)
    return ((np.clip(np.rint(h / scale) + zero, 0, 255) - zero) * scale).astype(np.float32)


def test_the_bound_holds_for_heavy_tailed_rows():
    rng = np.random.default_rng(0)
    e = (rng.standard_t(2, (500, 64)) * 0.05).astype(np.float32)  # outlier weights
    wq, s, coef, d = int8_rows(e)
    assert wq.dtype == np.int8 and wq.shape == (64, 500) and (d <= s / 2 + 1e-7).all()
    for _ in range(20):
        h = (rng.standard_t(1.5, (5, 64)) * 3).astype(np.float32)  # outlier activations
        hq = quantise_like_ort(h)
        approx = (hq @ wq.astype(np.float32)) * s
        exact = h.astype(np.float64) @ e.T.astype(np.float64)
        per_row = np.stack([np.abs(h).sum(1), np.abs(h - hq).max(1)], 1)
        assert (np.abs(exact - approx) <= per_row @ coef).all()


def head_graph(e: np.ndarray, candidates: int, chain: bool = False):
    """An ORT session of the head alone: inputs h [rows, K] and greedy (and ``chain``: the token fed after
    each row, input next), outputs logits, ids and the fallback count."""
    from onnx import TensorProto, helper

    v, k = e.shape
    spec = Spec({"model_type": "llama", "hidden_size": k, "num_hidden_layers": 1, "num_attention_heads": k // 16,
                 "intermediate_size": 32, "vocab_size": v, "tie_word_embeddings": True}, None)
    b = Builder(spec, {"model.embed_tokens.weight": e})
    b.weight("embed.weight", e)
    logits, ids = add(b, "h", "embed.weight", candidates, "next" if chain else None)
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["rows", k]),
              helper.make_tensor_value_info("greedy", TensorProto.BOOL, [1])]
    if chain:
        inputs.append(helper.make_tensor_value_info("next", TensorProto.INT64, ["rows"]))
    graph = helper.make_graph(
        b.nodes, "head", inputs,
        [helper.make_tensor_value_info(logits, TensorProto.FLOAT, None),
         helper.make_tensor_value_info(ids, TensorProto.INT64, None),
         helper.make_tensor_value_info("greedy_fallbacks", TensorProto.INT64, [])], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("candidates", [1, 4, 300])
def test_the_head_returns_the_argmax_of_its_own_logits(candidates):
    """C=300 of 300 rows certifies nearly every row (the candidates are everything); C=1 sends the near
    ties to the Gemm; rows with a clear winner certify at any C. Ties go to the lowest id, as np.argmax."""
    rng = np.random.default_rng(candidates)
    e = rng.normal(0, 0.05, (300, 32)).astype(np.float32)
    e[7] = e[250]  # an exact tie between two ids whenever one of them wins
    sess = head_graph(e, candidates)
    rows = [rng.normal(0, 1, (n, 32)).astype(np.float32) for n in (1, 2, 5, 5, 3)]
    rows += [e[[250, 3, 9]] * 40, e[[0, 7]] * 40 + rng.normal(0, 1e-3, (2, 32)).astype(np.float32)]
    for h in rows:
        logits, none, zero = sess.run(None, {"h": h, "greedy": np.array([False])})
        assert logits.shape == (len(h), 300) and none.shape == (0,) and zero == 0
        empty, ids, unsure = sess.run(None, {"h": h, "greedy": np.array([True])})
        assert empty.shape == (0, 300) and ids.dtype == np.int64 and 0 <= unsure <= len(h)
        np.testing.assert_array_equal(ids, logits.argmax(1))
    assert sess.run(None, {"h": e[[250]] * 40, "greedy": np.array([True])})[1][0] == 7


def test_the_fallback_count_is_real():
    """One candidate leaves every row whose runner-up is within the bound to the Gemm; all 300 leave none."""
    rng = np.random.default_rng(5)
    e = rng.normal(0, 0.05, (300, 32)).astype(np.float32)
    h = rng.normal(0, 1, (40, 32)).astype(np.float32)
    counts = {c: int(head_graph(e, c).run(None, {"h": h, "greedy": np.array([True])})[2]) for c in (1, 8, 300)}
    assert counts[1] > counts[8] >= counts[300] == 0 and counts[1] <= 40


def test_a_verification_reads_rows_up_to_the_first_rejection_only():
    """With the token fed after each row, rows after one known to differ skip the Gemm (-2 when uncertain);
    every row up to and including the first that differs is exact, so greedy acceptance reads only those."""
    rng = np.random.default_rng(3)
    e = rng.normal(0, 0.05, (300, 32)).astype(np.float32)
    full, chained = head_graph(e, 1), head_graph(e, 1, chain=True)
    skipped = 0
    for trial in range(30):
        h = rng.normal(0, 1, (6, 32)).astype(np.float32)
        argmax = full.run(None, {"h": h, "greedy": np.array([False])})[0].argmax(1)
        fed = rng.integers(0, 300, 5)
        keep = int(rng.integers(0, 5))
        fed[:keep] = argmax[:keep]  # the first `keep` drafts are right, then (almost surely) one is wrong
        ids, unsure = chained.run(None, {"h": h, "greedy": np.array([True]), "next": np.append(fed, -1)})[1:]
        assert ids_wrong(ids, argmax, fed) == 0 and unsure <= len(h)
        skipped += int((ids == -2).sum())
        all_right = chained.run(None, {"h": h, "greedy": np.array([True]), "next": np.append(argmax[:5], -1)})[1]
        np.testing.assert_array_equal(all_right, argmax)  # every draft right: every row is read
    assert skipped > 0  # one candidate leaves rows uncertain: after a rejection they were skipped


def test_ids_wrong_counts_what_the_contract_forbids():
    argmax, fed = np.array([4, 7, 1, 9]), np.array([4, 8, 1])  # row 1's argmax differs from its draft
    assert ids_wrong(np.array([4, 7, -2, -2]), argmax, fed) == 0
    assert ids_wrong(np.array([4, 7, 1, 9]), argmax, fed) == 0
    assert ids_wrong(np.array([4, -2, 1, 9]), argmax, fed) == 1  # a row up to the rejection must be exact
    assert ids_wrong(np.array([4, 7, 3, -2]), argmax, fed) == 1  # after it: exact or -2, never another id


def test_a_row_that_is_not_finite_gets_minus_one():
    e = np.random.default_rng(0).normal(0, 0.05, (50, 16)).astype(np.float32)
    h = np.ones((3, 16), np.float32)
    h[1, 4], h[2, 0] = np.nan, np.inf
    ids = head_graph(e, 4).run(None, {"h": h, "greedy": np.array([True])})[1]
    assert ids[0] >= 0 and ids[1] == -1 and ids[2] == -1


@pytest.mark.export
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_exported_models_pick_the_argmax_through_rollbacks(exported, family):
    out = exported(family, greedy_head=True)
    m = Manifest.load(out)
    assert m.inputs["greedy"] == "greedy" and m.outputs["next_ids"] == "next_ids"
    assert m.validation["passed"] and m.validation["greedy_ids_wrong"] == 0
    model = decoder_for(compile(out, CFG))
    assert model.greedy_ids
    rng = np.random.default_rng(2)
    ids = rng.integers(3, m.vocab_size, 40).tolist()
    model.forward_ids(ids[:12])
    for start in range(12, 36, 4):
        model.commit(start)
        logits = model.forward(ids[start:start + 5]).copy()  # a verify pass of 5 rows
        model.commit(start)
        assert ids_wrong(model.forward_ids(ids[start:start + 5]), logits.argmax(-1), ids[start + 1:start + 5]) == 0
        model.commit(start + 4)
        one = model.forward(ids[start + 4:start + 5], rows=1).copy()
        model.commit(start + 4)
        assert model.forward_ids(ids[start + 4:start + 5], rows=1)[0] == one.argmax()
    assert model.greedy_rows == 12 * 1 + 6 * (5 + 1) and 0 <= model.greedy_fallbacks <= model.greedy_rows


@pytest.mark.export
@pytest.mark.parametrize("k", [2, 5])
def test_speculation_through_a_head_that_rarely_certifies_is_exact(exported, k):
    """One candidate of 320: most rows fall back to the Gemm, rows after a rejection read -2; the session
    accepts only rows up to the first rejection, so the output still equals plain decoding's."""
    target = exported("llama", greedy_head=True, greedy_candidates=1)
    plain = Session(exported("llama"), None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    session = Session(target, DraftModel(exported("llama", seed=1), CFG), CFG, k=k)
    g = session.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    model = session.target
    assert g.token_ids == plain.token_ids and g.stats.accepted < g.stats.drafted  # rejections happened
    assert 0 < model.greedy_fallbacks < model.greedy_rows  # both paths ran


@pytest.mark.export
@pytest.mark.parametrize("k", [1, 4])
def test_a_draft_model_with_the_head_drafts_from_ids(exported, k):
    """The target itself as its draft, both with the head: every drafted id is the target's own argmax."""
    target = exported("qwen2", greedy_head=True)
    plain = Session(exported("qwen2"), None, CFG).generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    spec = DraftModel(target, CFG)
    assert spec.model.greedy_ids
    g = Session(target, spec, CFG, k=k).generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    assert g.token_ids == plain.token_ids and g.stats.acceptance_rate == 1.0 and g.stats.drafted >= 30 // (k + 1) * k - k
    other = Session(target, DraftModel(exported("qwen2", seed=1, greedy_head=True), CFG), CFG, k=k)
    assert other.generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids == plain.token_ids


def test_the_id_chain_stops_before_a_broken_id():
    steps = iter([7, -1, 5])
    p = DraftModel.chain_ids(3, 4, lambda x: next(steps))
    assert p.tokens.tolist() == [3, 7] and p.probs is None


@pytest.mark.export
def test_small_lm_heads_go_without_it_by_default_and_decode_the_same(exported):
    bare, head = exported("llama"), exported("llama", greedy_head=True)
    m = Manifest.load(bare)
    assert m.vocab_size * 64 < MIN_SIZE and not m.inputs.get("greedy") and not m.outputs.get("next_ids")
    assert not decoder_for(compile(bare, CFG)).greedy_ids
    prompt = "def add(a, b):\n    return a + b\n"
    a = Session(bare, None, CFG).generate(prompt, max_new_tokens=32, ignore_eos=True)
    b = Session(head, None, CFG).generate(prompt, max_new_tokens=32, ignore_eos=True)
    assert a.token_ids == b.token_ids and b.stats.emitted == 32


@pytest.mark.export
@pytest.mark.parametrize("kwargs, words", [({"dtype": "fp16"}, "float32 graphs"),
                                           ({"graph": "portable"}, "part of the fused graph"),
                                           ({"quantize": "int4"}, "float32 graphs")])
def test_the_head_is_refused_where_it_does_not_apply(exported, tmp_path, kwargs, words):
    import rlxrt

    with pytest.raises(ExportError, match=words):
        rlxrt.export(exported.source("llama"), tmp_path / "x", greedy_head=True, **kwargs)
