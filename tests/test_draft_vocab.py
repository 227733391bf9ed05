"""Draft-only exports (``rlxrt export --draft-vocab N --vocab-corpus PATH``): a fused draft whose logits cover
the N tokens a corpus uses most. Its export, exact greedy and sampled speculation with it (chi-square, with a
negative control), and the refusals."""
import json

import numpy as np
import pytest

import rlxrt
from rlxrt import Config, ExportError, Manifest, ModelFormatError, compile
from rlxrt.sampling import SamplingParams
from rlxrt.sessions import DraftModel, Session, decoder_for

from hf_models import CORPUS
from lossless import accept_ignoring_q, assert_first_two_tokens_follow, two_token_marginals

pytestmark = pytest.mark.export
CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n"
N = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "corpus.json"
    path.write_text(json.dumps(CORPUS * 3 + [PROMPT]))
    return path


@pytest.fixture(scope="module")
def reduced(exported, corpus, tmp_path_factory):
    """A draft-only export of another llama (seed 1) with N tokens, and one of the target's own weights."""
    root = tmp_path_factory.mktemp("reduced")
    out = {}
    for name, seed in (("other", 1), ("self", 0)):
        out[name] = root / name
        rlxrt.export(exported.source("llama", seed=seed), out[name], draft_vocab=N, vocab_corpus=[corpus])
    return out


def test_a_draft_vocab_export_keeps_the_corpus_tokens(exported, corpus, reduced):
    from tokenizers import Tokenizer

    m = Manifest.load(reduced["other"])
    assert m.graph_kind == "fused" and m.validation["passed"]
    assert m.draft_vocab["size"] == N and m.draft_vocab["ids"] == "draft_vocab.json"
    ids = np.array(json.loads((reduced["other"] / "draft_vocab.json").read_text()))
    assert len(ids) == N and np.all(np.diff(ids) > 0) and ids[-1] < m.vocab_size
    assert set(m.eos_token_ids) <= set(ids.tolist())  # the end of generation can always be drafted
    tok = Tokenizer.from_file(str(reduced["other"] / "tokenizer.json"))
    counts = np.bincount([t for text in json.loads(corpus.read_text())
                          for t in tok.encode(text, add_special_tokens=False).ids], minlength=m.vocab_size)
    left_out = np.setdiff1d(np.arange(m.vocab_size), ids)
    kept = np.setdiff1d(ids, m.eos_token_ids)
    assert counts[kept].min() >= counts[left_out].max()  # the most used tokens (ties aside)
    assert m.draft_vocab["corpus_coverage"] == round(counts[ids].sum() / counts.sum(), 4) < 1
    graph = compile(reduced["other"], CFG)
    assert [o.shape[-1] for o in graph.outputs if o.name == "logits"] == [N]
    model = decoder_for(graph)
    assert model.logits_width == N
    got = model.forward([5, 6, 7], rows=2).copy()
    full = decoder_for(compile(exported("llama", seed=1), CFG)).forward([5, 6, 7], rows=2)
    assert got.shape == (2, N) and np.allclose(got, full[:, ids], atol=1e-4)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("kernels", ["rlxrt", "ort"])
def test_greedy_speculation_with_a_draft_vocab_is_exact(exported, reduced, k, kernels):
    cfg = Config(intra_op_threads=1, cache=False, cpu_kernels=kernels)
    target = exported("llama")
    plain = Session(target, None, cfg).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    ids = set(json.loads((reduced["other"] / "draft_vocab.json").read_text()))
    for name in ("other", "self"):
        draft = DraftModel(reduced[name], cfg)
        drafted = set()
        orig = draft.propose

        def spy(ctx, k_, orig=orig):
            p = orig(ctx, k_)
            drafted.update(p.tokens.tolist())
            return p

        draft.propose = spy
        g = Session(target, draft, cfg, k=k).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
        assert g.token_ids == plain.token_ids, name
        assert drafted and drafted <= ids  # it drafts only its own tokens
        if name == "self":  # the target's own weights: every target token inside the subset is accepted
            assert g.stats.accepted > 0
        else:
            assert g.stats.rounds > 40 // (k + 1)  # rejections happened: rollbacks were exercised


def test_an_int8_draft_vocab_export_drafts_exactly(exported, corpus, tmp_path):
    out = tmp_path / "q8"
    m = rlxrt.export(exported.source("llama"), out, quantize="int8", draft_vocab=N, vocab_corpus=[corpus]).manifest
    assert m.dtype == "int8" and m.draft_vocab["size"] == N and m.validation["passed"]
    target = exported("llama")
    plain = Session(target, None, CFG).generate(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids
    got = Session(target, DraftModel(out, CFG), CFG, k=3).generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    assert got.token_ids == plain and got.stats.accepted > 0


def test_sampled_speculation_with_a_draft_vocab_is_lossless(exported, reduced, monkeypatch):
    """First and second tokens against the target's exact marginals, the draft's q zero outside its N tokens;
    then, as a negative control, the same test with an acceptance rule that ignores q (accepts when p > 0.5 q)
    must fail."""
    target = exported("llama")
    prompt = [5, 17, 42, 9]
    p1, p2 = two_token_marginals(decoder_for(compile(target, CFG)), prompt, SamplingParams(temperature=1.0))
    s = Session(target, DraftModel(reduced["other"], CFG), CFG, k=2)
    assert_first_two_tokens_follow(s, prompt, p1, p2, draws=3000)
    assert s.stats.accepted > 0

    monkeypatch.setattr("rlxrt.sessions.round.speculative_accept", accept_ignoring_q)
    broken = Session(target, DraftModel(reduced["other"], CFG), CFG, k=2)
    with pytest.raises(AssertionError):
        assert_first_two_tokens_follow(broken, prompt, p1, p2, draws=3000)


@pytest.mark.parametrize("ids, words", [(list(range(N - 1)), "must list 64"), (list(range(N))[::-1], "ascending"),
                                        ([*range(N - 1), 320], "below vocab_size 320"), ("x", "must list")])
def test_a_damaged_id_list_is_refused(reduced, tmp_path, ids, words):
    import shutil

    d = tmp_path / "d"
    shutil.copytree(reduced["other"], d)
    (d / "draft_vocab.json").write_text(json.dumps(ids))
    with pytest.raises(ModelFormatError, match=words):
        DraftModel(d, CFG)


@pytest.mark.parametrize("swap, words", [("fifo", "not a regular file"), ("outside", "outside the directory"),
                                         ("huge", "more than the")])
def test_an_id_list_that_is_no_file_of_the_directory_is_refused(reduced, tmp_path, swap, words):
    """The id list is one of the model directory's files: a FIFO (never opened blocking), a link to a file
    elsewhere or a file past its bound is refused, naming it."""
    import os
    import shutil

    d = tmp_path / "d"
    shutil.copytree(reduced["other"], d)
    ids = d / "draft_vocab.json"
    if swap == "fifo":
        ids.unlink()
        os.mkfifo(ids)
    elif swap == "outside":
        shutil.move(ids, tmp_path / "ids.json")
        os.symlink(tmp_path / "ids.json", ids)
    else:
        os.truncate(ids, 100 << 20)
    with pytest.raises(ModelFormatError, match=f"draft_vocab.ids.*{words}"):
        DraftModel(d, CFG)


def test_a_draft_only_export_is_refused_as_a_target(reduced):
    with pytest.raises(ModelFormatError, match="draft-only export.*64 of the 320 tokens.*--draft DIR"):
        Session(reduced["other"], None, CFG)


@pytest.mark.parametrize("kwargs, words", [
    ({"draft_vocab": N}, "pass --vocab-corpus"),
    ({"draft_vocab": 320, "corpus": True}, "between 1 and 319"),
    ({"draft_vocab": 1, "corpus": True}, "no room beside"),
    ({"draft_vocab": N, "corpus": True, "graph": "portable"}, "built into the fused graph"),
    ({"draft_vocab": N, "corpus": True, "greedy_head": True}, "greedy head reads"),
    ({"corpus": True}, "for --draft-vocab N"),
])
def test_bad_draft_vocab_exports(exported, corpus, tmp_path, kwargs, words):
    kwargs = dict(kwargs)
    if kwargs.pop("corpus", False):
        kwargs["vocab_corpus"] = [corpus]
    with pytest.raises(ExportError, match=words):
        rlxrt.export(exported.source("llama"), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_the_cli_exports_inspects_and_drafts_with_it(exported, corpus, tmp_path):
    import subprocess
    import sys

    def rlxrt_cli(*args):
        return subprocess.run([sys.executable, "-m", "rlxrt", *map(str, args)], capture_output=True, text=True)

    out = tmp_path / "d"
    r = rlxrt_cli("export", exported.source("llama", seed=1), out, "--draft-vocab", N, "--vocab-corpus", corpus)
    assert r.returncode == 0 and f"drafts {N} of 320 tokens" in r.stdout, r.stderr
    assert f"logits over {N} of them" in rlxrt_cli("inspect", out).stdout
    target = exported("llama")
    r = rlxrt_cli("generate", "--target", target, "--draft", out, "--prompt", PROMPT, "--max-new-tokens", 12,
                  "--json")
    plain = Session(target, None, CFG).generate(PROMPT, max_new_tokens=12)
    assert r.returncode == 0 and json.loads(r.stdout)["token_ids"] == plain.token_ids, r.stderr
    r = rlxrt_cli("generate", "--target", out, "--prompt", PROMPT)
    assert r.returncode != 0 and "draft-only export" in r.stderr
