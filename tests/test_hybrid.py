"""Hybrid graphs (attention with a KV cache plus recurrent layers with per-position states) through the
session: Jamba exported by `rlxrt export` (validated against transformers), and a tiny torch-built hybrid
whose calls take only 8 tokens (so long prompts cross chunk boundaries with both mechanisms). One commit
rolls the KV cache back by length and selects the recurrent state, both checked against feeding the
committed tokens one at a time; greedy speculation stays exact."""
import numpy as np
import pytest

from rlxrt import Config
from rlxrt.backends import compile
from rlxrt.sessions import DraftModel, PromptLookup, Session, StateModel, decoder_for

pytest.importorskip("torch", reason="builds its graph with torch.onnx")
CFG = Config(intra_op_threads=1, cache=False)


@pytest.fixture(scope="module", params=["jamba", "tiny"])
def hybrid(request, tmp_path_factory):
    if request.param == "jamba":
        return request.getfixturevalue("exported")("jamba", seed=0, layers=4)
    from hybrid import make_hybrid

    return make_hybrid(tmp_path_factory.mktemp("hybrid") / "target")


@pytest.fixture(scope="module")
def hybrid_draft(hybrid, exported, tmp_path_factory):
    if "jamba" in hybrid.name:
        return exported("jamba", seed=1, layers=2, hidden=32)
    from hybrid import make_hybrid

    return make_hybrid(tmp_path_factory.mktemp("hybrid") / "draft", seed=1, hidden=16, state=8)


def sequential(path, tokens):
    m = StateModel(compile(path, CFG))
    rows = [m.forward([t])[0] for t in tokens]
    return m, np.stack(rows)


def test_hybrid_manifest_gets_both_mechanisms(hybrid):
    m = decoder_for(compile(hybrid, CFG))
    assert isinstance(m, StateModel) and m.kv is not None and m.state_inputs
    man = m.manifest
    if man.model_type == "jamba":  # layers 1, 3 attention; 0, 2 Mamba
        assert man.kv_cache.layers == 2 and man.state.tensors[0].shape[0] == 2
        v = man.validation
        assert v["passed"] and v["max_abs_diff"] < 1e-4 and v["max_abs_diff_state"] < 1e-4


def test_chunks_of_a_long_prompt_carry_both_the_cache_and_the_state(hybrid):
    tokens = np.random.default_rng(0).integers(3, 320, 70).tolist()  # 3 chunks of 32 (Jamba), 9 of 8 (tiny)
    m = StateModel(compile(hybrid, CFG))
    logits = m.forward(tokens)
    ref, ref_rows = sequential(hybrid, tokens)
    np.testing.assert_allclose(logits, ref_rows, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(m.state()[0], ref.state()[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_commit_rolls_back_the_cache_and_selects_the_state(hybrid, k):
    rng = np.random.default_rng(k)
    prefix = rng.integers(3, 320, 10).tolist()
    for kept in range(1, k + 2):  # j = kept - 1 accepted drafts; kept = k + 1: all accepted (bonus row)
        m = StateModel(compile(hybrid, CFG))
        m.forward(prefix)
        fed = rng.integers(3, 320, k + 1).tolist()
        m.forward(fed)
        m.commit(len(prefix) + kept)
        nxt = rng.integers(3, 320, 3).tolist()
        after = m.forward(nxt)
        committed = prefix + fed[:kept] + nxt
        ref, ref_rows = sequential(hybrid, committed)
        np.testing.assert_allclose(after, ref_rows[-3:], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(m.state()[0], ref.state()[0], rtol=1e-4, atol=1e-5)
        assert m.kv.cache[0].shape[2] == len(committed)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("draft", ["hybrid", "lookup"])
def test_greedy_speculative_equals_plain_with_a_hybrid_target(hybrid, hybrid_draft, k, draft):
    prompt = [5, 17, 42, 9, 5, 17, 42]
    plain = Session(hybrid, None, CFG).generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
    spec = PromptLookup() if draft == "lookup" else DraftModel(hybrid_draft, CFG)
    s = Session(hybrid, spec, CFG, k=k)
    g = s.generate(prompt, max_new_tokens=30, ignore_eos=True)
    assert g.token_ids == plain and g.stats.drafted > 0
    assert s.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids == plain  # state reset between requests
