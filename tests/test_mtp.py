"""The MTP draft head on real exported graphs: a random-init Llama target exported with its hidden
states, and a random-init head written by exporters.mtp (validated against torch).

The head's recurrent state after each commit is checked against feeding the committed tokens one at a
time; through Session: greedy exactness, sampled losslessness, several requests, bad bindings.
"""
import numpy as np
import pytest

import rlxrt
from rlxrt import Config
from rlxrt.backends import compile
from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.sampling import SamplingParams
from rlxrt.speculator import AcceptDecision, Context, Prefill, VerifyResult
from rlxrt.sessions import DraftModel, MtpHead, Session, StateModel, decoder_for

from conftest import link_or_copy
from lossless import assert_first_two_tokens_follow, two_token_marginals

pytestmark = pytest.mark.export
CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def make_head(target_dir, src_dir, out, seed=0, quantize=None, attention_heads=0):
    import torch
    import transformers as tf

    from rlxrt.app.api import runner
    from rlxrt.exporters.mtp import HeadConfig, build_head, write_head

    model = tf.AutoModelForCausalLM.from_pretrained(str(src_dir))
    cfg = HeadConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size, state_size=24,
                     intermediate_size=48, attention_heads=attention_heads)
    torch.manual_seed(seed)
    head = build_head(torch, cfg, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    write_head(torch, head, cfg, rlxrt.Manifest.load(target_dir), out, runner, quantize)
    return out


@pytest.fixture(scope="module")
def target(exported):
    return exported("llama", seed=0, with_hidden=True)


@pytest.fixture(scope="module")
def head(exported, target, tmp_path_factory):
    return make_head(target, exported.source("llama", seed=0), tmp_path_factory.mktemp("mtp") / "head")


@pytest.fixture(scope="module")
def plain(exported):
    return Session(exported("llama", seed=0), None, CFG).generate(PROMPT, max_new_tokens=40,
                                                                  ignore_eos=True).token_ids


def test_export_with_hidden_states_matches_torch(exported, target):
    import torch
    import transformers as tf

    m = rlxrt.Manifest.load(target)
    assert m.outputs["hidden_states"] == "hidden_states"
    assert m.validation["passed"] and m.validation["max_abs_diff_hidden"] < 1e-4
    model = decoder_for(compile(target, CFG))
    model.fetch_hidden()
    ids = [5, 9, 40, 7, 12, 3]
    model.forward(ids[:4])
    first = model.hidden.copy()  # a fused graph's buffer, rewritten by the next call
    model.forward(ids[4:])
    src = tf.AutoModelForCausalLM.from_pretrained(str(exported.source("llama", seed=0)))
    with torch.no_grad():
        ref = src.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
    np.testing.assert_allclose(np.concatenate([first, model.hidden]), ref, atol=1e-4)
    assert rlxrt.Manifest.load(exported("llama", seed=0)).outputs["hidden_states"] is None


def test_gpt2_exports_its_hidden_states_too(exported):
    m = rlxrt.Manifest.load(exported("gpt2", seed=0, with_hidden=True))
    assert m.outputs["hidden_states"] == "hidden_states" and m.validation["max_abs_diff_hidden"] < 1e-4


def test_head_export_is_validated_and_declares_its_state(head, target):
    m = rlxrt.Manifest.load(head)
    assert m.draft_head["kind"] == "mtp" and m.draft_head["hidden_size"] == 64
    assert m.draft_head["target"]["weights_sha256"] == rlxrt.Manifest.load(target).source["weights_sha256"]
    (state,) = m.state.tensors
    assert (state.input, state.output, state.shape) == ("state", "states", (24,))
    v = m.validation
    assert v["passed"] and v["max_abs_diff"] < 1e-4 and v["max_abs_diff_state"] < 1e-5
    import onnx

    weights = onnx.load(str(head / "model.onnx")).graph.initializer
    big = [w for w in weights if len(w.dims) == 2]
    assert big and all(w.data_type == onnx.TensorProto.FLOAT16 for w in big)  # stored as float16, run as float32


def sequential_state(head_dir, tokens):
    """The head's state after consuming ``tokens`` one call per token (the hidden input does not reach it)."""
    m = StateModel(compile(head_dir, CFG))
    for t in tokens:
        m.forward([t], np.zeros((1, 64), np.float32))
    return m.state()[0]


@pytest.fixture(scope="module")
def mamba_pair(exported, tmp_path_factory):
    target = exported("mamba", seed=0, with_hidden=True)
    return target, make_head(target, exported.source("mamba", seed=0), tmp_path_factory.mktemp("mtp") / "head")


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["llama", "mamba"])
def test_head_state_after_commit_equals_feeding_the_committed_tokens_one_at_a_time(request, kind, k):
    """Drive propose / verify / commit by hand with forced accept patterns j = 0..k (j = k: bonus), for a
    transformer and a recurrent target."""
    target, head = (request.getfixturevalue("target"), request.getfixturevalue("head")) if kind == "llama" \
        else request.getfixturevalue("mamba_pair")
    rng = np.random.default_rng(k)
    tgt = decoder_for(compile(target, CFG))
    spec = MtpHead(head, CFG)
    spec.bind(tgt)
    vocab = tgt.vocab_size
    ctx = Context(tokens=rng.integers(3, vocab, 9).tolist(), params=SamplingParams(), rng=np.random.default_rng(0))
    tgt.forward(ctx.tokens[:-1])
    spec.prefill(ctx, Prefill(hidden=tgt.hidden))
    patterns = list(range(k + 1)) * 2
    rng.shuffle(patterns)
    for j in patterns:
        drafted = spec.propose(ctx, k).tokens
        assert len(drafted) == k
        logits = tgt.forward([ctx.tokens[-1], *drafted])
        verify = VerifyResult(logits, hidden=tgt.hidden)
        new = np.append(drafted[:j], rng.integers(3, vocab))
        decision = AcceptDecision(j, new.astype(np.int64), bonus=j == k)
        ctx.tokens.extend(new.tolist())
        tgt.commit(len(ctx.tokens) - 1)
        spec.commit(ctx, decision, verify)
        n = len(ctx.tokens)
        assert spec.model.length == (n - 2 if j < k else n - 3)  # after a full acceptance: the last draft unread
        want = sequential_state(head, ctx.tokens[1:spec.model.length + 1])
        np.testing.assert_allclose(spec.model.state()[0], want, atol=1e-5)
        # the kept hidden state is the target's own, of the position before the pending token
        ref = decoder_for(compile(target, CFG))
        ref.fetch_hidden()
        ref.forward(ctx.tokens[:-1])
        np.testing.assert_allclose(spec.last, ref.hidden[n - 2:n - 1], atol=1e-4)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_the_mtp_head_equals_plain_greedy(target, head, plain, k):
    g = Session(target, MtpHead(head, CFG), CFG, k=k).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert g.token_ids == plain
    assert g.stats.drafted > 0 and g.stats.providers["draft"] == ["cpu"]


def test_a_head_whose_chain_ends_below_min_prob_drafts_less_and_stays_exact(target, head, plain):
    drafted = {}
    for p in (0.0, 0.05, 0.5):
        g = Session(target, MtpHead(head, CFG, min_prob=p), CFG, k=4).generate(PROMPT, max_new_tokens=40,
                                                                              ignore_eos=True)
        assert g.token_ids == plain
        drafted[p] = g.stats.drafted_per_position
        assert drafted[p][0] > 0 and all(a >= b for a, b in zip(drafted[p], drafted[p][1:]))
    assert sum(drafted[0.5]) < sum(drafted[0.0])  # chains ended early (the random head is rarely sure)


@pytest.fixture(scope="module")
def int4_head(exported, target, tmp_path_factory):
    return make_head(target, exported.source("llama", seed=0), tmp_path_factory.mktemp("mtp") / "head4",
                     quantize="int4")


@pytest.fixture(scope="module")
def int8_head(exported, target, tmp_path_factory):
    return make_head(target, exported.source("llama", seed=0), tmp_path_factory.mktemp("mtp") / "head8",
                     quantize="int8")


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantised_head_is_cheaper_and_speculation_with_it_stays_exact(target, head, int4_head, int8_head, plain,
                                                                         bits):
    import onnx

    quantised = int4_head if bits == 4 else int8_head
    m = rlxrt.Manifest.load(quantised)
    assert m.dtype == f"int{bits}" and m.quantization["method"] == "MatMulNBits" and m.validation["passed"]
    assert m.quantization["bits"] == bits
    assert 0 < m.validation["max_abs_diff"] <= m.validation["tolerance"]  # not float32, but close
    graph = onnx.load(str(quantised / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == 5 and "MatMul" not in ops
    assert {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"} == {bits}
    embedding = {i.name: i.data_type for i in graph.initializer if i.name.startswith("embed")}
    assert embedding == ({"embed_fp16": onnx.TensorProto.FLOAT16} if bits == 4 else
                         {"embed.q8": onnx.TensorProto.INT8, "embed.scales": onnx.TensorProto.FLOAT})
    for k in (1, 3):
        g = Session(target, MtpHead(quantised, CFG), CFG, k=k).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
        assert g.token_ids == plain and g.stats.drafted > 0
    # the state path is quantised too, and still a function of the tokens alone: the per-position states of
    # one call equal feeding the same tokens one at a time (what makes commit exact without a re-run)
    tokens = [3, 17, 5, 40, 2]
    mq = StateModel(compile(quantised, CFG))
    mq.forward(tokens, np.zeros((1, 64), np.float32))
    np.testing.assert_allclose(mq.state()[0], sequential_state(quantised, tokens), atol=1e-4)


def test_an_int8_head_is_closer_to_its_torch_module_than_an_int4_one(int4_head, int8_head):
    """The same weights (same seed): 8-bit blocks and int8 embedding rows stay nearer the float head."""
    four, eight = (rlxrt.Manifest.load(h).validation for h in (int4_head, int8_head))
    assert eight["max_abs_diff"] < four["max_abs_diff"] / 4
    assert eight["max_abs_diff_hidden"] < four["max_abs_diff_hidden"]


def test_a_one_token_prompt_drafts_from_the_second_round_on(target, head, exported):
    plain = Session(exported("llama", seed=0), None, CFG).generate([7], max_new_tokens=12, ignore_eos=True)
    g = Session(target, MtpHead(head, CFG), CFG, k=3).generate([7], max_new_tokens=12, ignore_eos=True)
    assert g.token_ids == plain.token_ids and g.stats.drafted > 0


def test_several_requests_in_a_row_reset_the_head(target, head, plain):
    s = Session(target, MtpHead(head, CFG), CFG, k=3)
    other = s.generate("class Point:\n", max_new_tokens=25, ignore_eos=True).token_ids
    assert s.generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids == plain
    with pytest.raises(GenerationError):
        s.generate(PROMPT, max_new_tokens=10, top_p=2.0)
    assert s.generate("class Point:\n", max_new_tokens=25, ignore_eos=True).token_ids == other
    assert s.generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids == plain


def test_sampled_output_with_the_mtp_head_has_the_targets_distribution(target, head):
    """First and second emitted tokens against the target's exact marginals (the second by enumerating
    the first), over many seeds: accepted, recovered and bonus paths all feed the counts."""
    p1, p2 = two_token_marginals(decoder_for(compile(target, CFG)), [5, 17, 42, 9], SamplingParams(temperature=1.0))
    s = Session(target, MtpHead(head, CFG), CFG, k=2)
    assert_first_two_tokens_follow(s, [5, 17, 42, 9], p1, p2, draws=5000)
    assert s.stats.accepted > 0 and s.stats.acceptance_rate < 0.95


def test_head_on_its_own_session_settings(target, head, plain):
    """The head compiles with its own config (on a GPU machine: another provider); its state and the
    target's hidden rows are host arrays, so they cross between the two sessions as numpy."""
    head_cfg = Config(intra_op_threads=2, graph_optimization="disable", cache=False)
    s = Session(target, MtpHead(head, head_cfg), CFG, k=4)
    assert s.generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids == plain
    assert s.speculator.model.graph.session.get_session_options().intra_op_num_threads == 2


def test_bad_bindings_are_clear_errors(exported, head, tmp_path):
    with pytest.raises(GenerationError, match="--with-hidden-states"):
        Session(exported("llama", seed=0), MtpHead(head, CFG), CFG)  # its own target, without hidden states
    with pytest.raises(ModelFormatError, match="draft head"):
        Session(head, None, CFG)
    with pytest.raises(ModelFormatError, match="draft head"):
        DraftModel(head, CFG)
    with pytest.raises(ModelFormatError, match="not an MTP head"):
        MtpHead(exported("llama", seed=0), CFG)
    other = exported("llama", seed=3, with_hidden=True, hidden=32)
    with pytest.raises(GenerationError, match="has no hidden_states output.*--with-hidden-states"):
        Session(exported("mamba", seed=0), MtpHead(head, CFG), CFG)  # what every head needs comes first
    with pytest.raises(GenerationError, match="weights hash"):  # a head drafts for the target it was trained for
        Session(other, MtpHead(head, CFG), CFG)
    # a head that records no target hash is still checked for what it reads
    import json

    bare = tmp_path / "bare-head"
    bare.mkdir()
    for f in head.iterdir():
        if f.name != "rlxrt.json":
            link_or_copy(f, bare / f.name)
    data = json.loads((head / "rlxrt.json").read_text())
    del data["draft_head"]["target"]["weights_sha256"]
    (bare / "rlxrt.json").write_text(json.dumps(data))
    with pytest.raises(GenerationError, match="hidden states of size 64, the target's are 32"):
        Session(other, MtpHead(bare, CFG), CFG)
    with pytest.raises(GenerationError, match="--with-hidden-states"):
        Session(exported("mamba", seed=0), MtpHead(bare, CFG), CFG)


def test_a_long_prompt_is_read_in_chunks(target, head, exported):
    """A prompt longer than the head's 32 positions per call: the state after prefill equals the
    sequential one, and generation stays exact."""
    prompt = (PROMPT * 4)[:150]
    tgt = decoder_for(compile(target, CFG))
    spec = MtpHead(head, CFG)
    spec.bind(tgt)
    ctx = Context(tokens=Session(target, None, CFG)._prompt_ids(prompt), params=SamplingParams(),
                  rng=np.random.default_rng(0))
    assert len(ctx.tokens) > 70
    tgt.forward(ctx.tokens[:-1])
    spec.prefill(ctx, Prefill(hidden=tgt.hidden))
    np.testing.assert_allclose(spec.model.state()[0], sequential_state(head, ctx.tokens[1:-1]), atol=1e-5)
    plain = Session(exported("llama", seed=0), None, CFG).generate(prompt, max_new_tokens=20, ignore_eos=True)
    g = Session(target, MtpHead(head, CFG), CFG, k=3).generate(prompt, max_new_tokens=20, ignore_eos=True)
    assert g.token_ids == plain.token_ids


@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_mtp_head_for_recurrent_and_hybrid_targets(exported, family, tmp_path):
    """`--with-hidden-states` on a recurrent (Mamba) and a hybrid (Jamba) export: the hidden state is
    validated, and a head bound to it drafts with exact greedy output (target state, KV cache and head
    state all rolled back in the same commits)."""
    kw = {"layers": 4} if family == "jamba" else {}
    target = exported(family, seed=0, with_hidden=True, **kw)
    m = rlxrt.Manifest.load(target)
    assert m.outputs["hidden_states"] == "hidden_states" and m.validation["max_abs_diff_hidden"] < 1e-4
    head = make_head(target, exported.source(family, seed=0, **kw), tmp_path / "head")
    plain = Session(exported(family, seed=0, **kw), None, CFG).generate(PROMPT, max_new_tokens=30,
                                                                       ignore_eos=True).token_ids
    for k in (1, 3):
        g = Session(target, MtpHead(head, CFG), CFG, k=k).generate(PROMPT, max_new_tokens=30, ignore_eos=True)
        assert g.token_ids == plain and g.stats.drafted > 0


def test_cli_generate_with_a_head(exported, target, head, plain):
    import json
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "rlxrt", "generate", "--target", str(target), *args],
                              capture_output=True, text=True, timeout=300)

    r = cli("--head", str(head), "-k", "3", "--prompt", PROMPT, "--max-new-tokens", "40", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == plain and out["stats"]["speculator"] == "mtp-head"
    r = cli("--head", str(head), "-k", "3", "--min-draft-prob", "0.3", "--prompt", PROMPT, "--max-new-tokens", "40",
            "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == plain
    r = cli("--speculator", "prompt-lookup", "--min-draft-prob", "0.3", "--prompt", PROMPT)
    assert r.returncode == 2 and "--min-draft-prob needs a draft model or head" in r.stderr
    r = cli("--head", str(head), "--min-draft-prob", "1.5", "--prompt", PROMPT)
    assert r.returncode == 1 and "--min-draft-prob must be in [0, 1), got 1.5" in r.stderr
    r = cli("--speculator", "mtp", "--prompt", PROMPT)  # no head shipped for this target
    assert r.returncode == 2 and "needs --head DIR" in r.stderr
    r = cli("--head", str(head), "--speculator", "prompt-lookup", "--prompt", PROMPT)
    assert r.returncode == 2 and "exclude each other" in r.stderr


def test_bench_runs_several_heads_side_by_side(target, head, int4_head):
    from rlxrt.app.bench import run_bench

    res = run_bench(target, None, [PROMPT], max_new_tokens=16, repeats=1, temperatures=(0.0,), ks=(2,),
                    progress=False, head_dir=[head, int4_head], config=CFG, min_prob=0.3)
    rows = res["temperatures"]["0.0"]
    assert {"mtp[head] k=2", "mtp[head4] k=2", "lookup+mtp[head] k=2", "mtp[head] k=2 p>=0.3",
            "lookup+mtp[head4] k=2 p>=0.3"} <= set(rows)
    assert res["config"]["head"] == "head,head4" and res["config"]["min_prob"] == 0.3
    assert all(rows[n]["acceptance_rate"] >= 0 and rows[n]["tokens_per_s"] > 0 for n in rows)
