"""Recurrent state under speculation, on real exported random-init Mamba graphs.

The graph returns the state after each fed token; commit selects the state at
the last accepted position. Checked against feeding the committed tokens one
at a time, and through Session: greedy exactness with recurrent targets and
drafts, sampled losslessness, several requests in a row.
"""
import json

import numpy as np
import pytest

import rlxrt
from rlxrt import Config
from rlxrt.backends import compile
from rlxrt.errors import ExportError, GenerationError
from rlxrt.sampling import SamplingParams
from rlxrt.sessions import DraftModel, PromptLookup, Session, StateModel

from lossless import assert_first_two_tokens_follow, two_token_marginals

pytestmark = pytest.mark.export
CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture(scope="module")
def mamba(exported):
    return exported("mamba", seed=0)


def fresh(path) -> StateModel:
    return StateModel(compile(path, CFG))


def test_export_writes_state_layout_and_validates(exported, mamba):
    m = rlxrt.Manifest.load(mamba)
    cfg = json.loads((exported.source("mamba", seed=0) / "config.json").read_text())
    assert m.kv_cache is None and m.state is not None and m.model_type == "mamba"
    conv, ssm = m.state.tensors
    assert (conv.input, conv.output, ssm.input, ssm.output) == ("conv_state", "conv_states", "ssm_state", "ssm_states")
    layers, inner = cfg["num_hidden_layers"], cfg["intermediate_size"]
    assert conv.shape == (layers, 1, inner, cfg["conv_kernel"]) and ssm.shape == (layers, 1, inner, cfg["state_size"])
    v = m.validation
    assert v["passed"] and v["max_abs_diff"] < 1e-4 and v["max_abs_diff_state"] < 1e-4
    assert v["argmax_agreement"] == 1.0 and m.tokenizer == "tokenizer.json"


def test_fp16_of_a_recurrent_model_is_a_clear_error(exported, tmp_path):
    src = exported.source("mamba", seed=0)
    with pytest.raises(ExportError, match="fp32 only"):
        rlxrt.export(src, tmp_path / "out", dtype="fp16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_commit_selects_the_state_of_the_last_accepted_position(mamba, k):
    rng = np.random.default_rng(k)
    vocab = rlxrt.Manifest.load(mamba).vocab_size
    prefix = rng.integers(0, vocab, 11).tolist()
    fed = rng.integers(0, vocab, k + 1).tolist()     # the pending token and k drafted ones
    model = fresh(mamba)
    for keep in range(1, k + 2):                      # keep-1 accepted; keep == k+1: all accepted + bonus row
        model.reset()
        model.forward(prefix)
        rows = model.forward(fed)                     # ONE call over k+1 tokens
        assert rows.shape == (k + 1, vocab)
        model.commit(len(prefix) + keep)
        ref = fresh(mamba)
        for t in prefix + fed[:keep]:                 # the plain model, one token at a time
            last = ref.forward([t])
        for got, want in zip(model.state(), ref.state()):
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(rows[keep - 1], last[0], atol=2e-4, rtol=1e-4)
        nxt = int(rng.integers(0, vocab))             # and it continues identically
        np.testing.assert_allclose(model.forward([nxt]), ref.forward([nxt]), atol=2e-4, rtol=1e-4)


def test_long_prompts_go_in_chunks_and_match_single_steps(mamba):
    model = fresh(mamba)
    ids = np.random.default_rng(0).integers(0, model.vocab_size, 2 * model.chunk + 7).tolist()
    rows = model.forward(ids)
    ref = fresh(mamba)
    single = np.concatenate([ref.forward([t]) for t in ids])
    np.testing.assert_allclose(rows, single, atol=2e-4, rtol=1e-4)
    for got, want in zip(model.state(), ref.state()):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_commit_cannot_go_behind_the_last_commit(mamba):
    model = fresh(mamba)
    model.forward([1, 2, 3, 4])
    model.commit(3)
    assert model.length == 3 and len(model.state()) == 2
    with pytest.raises(GenerationError, match="commits forward only"):
        model.commit(2)


@pytest.fixture(scope="module")
def plain_mamba(mamba):
    return Session(mamba, None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("draft", ["mamba", "llama", "lookup"])
def test_greedy_speculative_equals_plain_with_a_recurrent_target(exported, mamba, plain_mamba, k, draft):
    spec = PromptLookup() if draft == "lookup" else DraftModel(exported(draft, seed=1, layers=1, hidden=32), CFG)
    g = Session(mamba, spec, CFG, k=k).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert g.token_ids == plain_mamba
    if draft != "lookup":
        assert g.stats.acceptance_rate < 1.0  # rejections happened, so commits rolled state back
    assert g.stats.drafted > 0


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_exact_with_a_recurrent_draft_for_an_attention_target(exported, k):
    target = exported("llama", seed=0)
    plain = Session(target, None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids
    spec = DraftModel(exported("mamba", seed=2, layers=1, hidden=32), CFG)
    g = Session(target, spec, CFG, k=k).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert g.token_ids == plain and 0 < g.stats.acceptance_rate < 1.0


def test_several_requests_in_a_row_reset_the_state(exported, mamba, plain_mamba):
    s = Session(mamba, DraftModel(exported("mamba", seed=1, layers=1, hidden=32), CFG), CFG, k=3)
    other = s.generate("class Point:\n", max_new_tokens=25, ignore_eos=True).token_ids
    assert s.generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids == plain_mamba
    with pytest.raises(GenerationError):
        s.generate(PROMPT, max_new_tokens=10, temperature=-1)
    assert s.generate("class Point:\n", max_new_tokens=25, ignore_eos=True).token_ids == other
    assert s.generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids == plain_mamba


def test_sampled_output_of_a_stateful_pair_has_the_targets_distribution(exported, mamba):
    """Second emitted token (after a recovered or accepted first one, or as a bonus): its marginal
    against the target's exact one, computed by enumerating the first token."""
    p1, p2 = two_token_marginals(fresh(mamba), [5, 17, 42], SamplingParams(temperature=1.0))
    s = Session(mamba, DraftModel(exported("mamba", seed=1, layers=1, hidden=32), CFG), CFG, k=2)
    assert_first_two_tokens_follow(s, [5, 17, 42], p1, p2, draws=6000)
    assert 0.05 < s.stats.acceptance_rate < 0.95


def test_draft_and_target_on_separate_sessions_with_their_own_settings(exported, mamba, plain_mamba):
    """The draft compiles with its own config (on a GPU machine: another provider); states stay host arrays
    owned by each model, so nothing crosses between the two sessions but token ids."""
    draft_cfg = Config(intra_op_threads=2, graph_optimization="disable", cache=False)
    spec = DraftModel(exported("mamba", seed=1, layers=1, hidden=32), draft_cfg)
    s = Session(mamba, spec, CFG, k=4)
    assert s.generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids == plain_mamba
    assert s.speculator.model.graph.session.get_session_options().intra_op_num_threads == 2


def test_falcon_mamba_exports_and_speculates_exactly(exported):
    """FalconMamba: Mamba with weightless RMS norms on dt, B and C, through the same exporter."""
    path = exported("falcon_mamba", seed=0)
    m = rlxrt.Manifest.load(path)
    assert m.model_type == "falcon_mamba" and m.state is not None and m.kv_cache is None
    assert m.validation["passed"] and m.validation["max_abs_diff"] < 1e-4 and m.validation["max_abs_diff_state"] < 1e-4
    plain = Session(path, None, CFG).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids
    for spec in (PromptLookup(), DraftModel(exported("mamba", seed=1, layers=1, hidden=32), CFG)):
        g = Session(path, spec, CFG, k=3).generate(PROMPT, max_new_tokens=30, ignore_eos=True)
        assert g.token_ids == plain and g.stats.drafted > 0
