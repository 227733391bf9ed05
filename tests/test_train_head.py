"""`rlxrt train-head`: a head trained on a tiny exported target's own graph (KV and recurrent), with the full
and a reduced draft vocabulary; speculation with it stays exact (greedy equal, sampled by chi-square, with a
negative control that breaks the acceptance rule and must fail)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rlxrt.app.cli import main
from rlxrt.config import Config
from rlxrt.sampling import SamplingParams

pytestmark = pytest.mark.export
CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from hf_models import CORPUS

    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(12):  # documents of shuffled corpus lines: held-out split by file
        lines = [line for text in CORPUS for line in text.splitlines()] * 6
        rng.shuffle(lines)
        (d / f"doc{i:02d}.py").write_text("\n".join(lines) + "\n")
    (d / "binary.bin").write_bytes(bytes(range(256)))  # not a text suffix: skipped
    return d


def _train(target, corpus, out, *extra):
    rc = main(["train-head", str(target), "--corpus", str(corpus), "--out", str(out), "--steps", "60",
               "--batch", "4", "--max-tokens", "6000", "--threads", "1", "--quiet", *extra])
    assert rc == 0
    log = [json.loads(line) for line in (out / ".train" / "log.jsonl").read_text().splitlines()]
    first, last = np.mean([r["loss"] for r in log[:10]]), np.mean([r["loss"] for r in log[-10:]])
    assert last < 0.9 * first, (first, last)  # it learns (a random target is near uniform: its floor is high)
    return json.loads((out / "train_report.json").read_text())


@pytest.fixture(scope="module")
def llama(exported):
    return exported("llama", with_hidden=True)


@pytest.fixture(scope="module")
def reduced_head(llama, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "reduced"
    report = _train(llama, corpus, out, "--draft-vocab", "64")
    return out, report


def test_full_vocabulary_head(llama, corpus, tmp_path, capsys):
    from rlxrt.manifest import Manifest
    from rlxrt.sessions import MtpHead, Session

    report = _train(llama, corpus, tmp_path / "head", "--draft-vocab", "0", "--quantize", "none")
    assert report["draft_vocab"] == 320 and report["output_rows_error"] < 1e-4 and report["validation"]["passed"]
    assert len(report["heldout_acceptance_per_position"]) == 4
    assert 0 <= report["fit"]["train_agree1"] <= 1 and report["fit"]["heldout_agree1"] == report["heldout"]["agree1"]
    m = Manifest.load(tmp_path / "head")
    assert m.draft_head["kind"] == "mtp" and "draft_vocab" not in m.draft_head
    assert m.dtype == "float32" and m.quantization is None and report["validation"]["max_abs_diff"] < 1e-4
    plain = Session(llama, None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    s = Session(llama, MtpHead(tmp_path / "head", CFG), CFG, k=3)
    g = s.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert g.token_ids == plain.token_ids and g.stats.drafted > 0  # exact (a random target: few accepted)


def test_reduced_vocabulary_head_is_greedy_exact(llama, reduced_head):
    from rlxrt.manifest import Manifest
    from rlxrt.sessions import MtpHead, Session

    out, report = reduced_head
    m = Manifest.load(out)
    ids = json.loads((out / "draft_vocab.json").read_text())
    assert m.draft_head["draft_vocab"] == 64 == len(ids) == len(set(ids)) and report["draft_vocab"] == 64
    assert m.dtype == "int8" and m.quantization["accuracy_level"] == 4 and report["quantize"] == "int8"
    import onnx

    graph = onnx.load(str(out / "model.onnx")).graph
    ops = {n.op_type for n in graph.node}
    assert "MatMulNBits" in ops and "MatMul" not in ops  # the default: every projection int8
    # its logits are its 64 tokens' alone, named by the manifest as a draft-only export's are
    assert [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim] == [1, 1, 64]
    assert m.draft_vocab == {"size": 64, "ids": "draft_vocab.json"}
    head = MtpHead(out, CFG)
    plain = Session(llama, None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    s = Session(llama, head, CFG, k=4)
    assert s.generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids == plain.token_ids
    drafted = set()
    orig = head.propose

    def spy(ctx, k):
        p = orig(ctx, k)
        drafted.update(p.tokens.tolist())
        return p

    head.propose = spy
    s.generate(PROMPT, max_new_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    assert drafted and drafted <= set(ids)  # it drafts only its own tokens


def test_reduced_vocabulary_head_sampled_is_lossless(llama, reduced_head, monkeypatch):
    """First and second tokens against the target's exact marginals; then, as a negative control, the same
    test with an acceptance rule that ignores the draft's probabilities (accepts when p/q > 0.5) must fail."""
    from lossless import accept_ignoring_q, assert_first_two_tokens_follow, two_token_marginals

    from rlxrt.backends import compile
    from rlxrt.sessions import MtpHead, Session
    from rlxrt.sessions.state import decoder_for

    out, _ = reduced_head
    prompt = [5, 17, 42, 9]
    p1, p2 = two_token_marginals(decoder_for(compile(llama, CFG)), prompt, SamplingParams(temperature=1.0))
    s = Session(llama, MtpHead(out, CFG), CFG, k=2)
    assert_first_two_tokens_follow(s, prompt, p1, p2, draws=4000)
    assert s.stats.accepted > 0

    monkeypatch.setattr("rlxrt.sessions.round.speculative_accept", accept_ignoring_q)
    broken = Session(llama, MtpHead(out, CFG), CFG, k=2)
    with pytest.raises(AssertionError):
        assert_first_two_tokens_follow(broken, prompt, p1, p2, draws=4000)


def test_train_head_on_a_recurrent_target(exported, corpus, tmp_path):
    from rlxrt.sessions import MtpHead, Session

    mamba = exported("mamba", with_hidden=True)
    report = _train(mamba, corpus, tmp_path / "head", "--draft-vocab", "100")
    assert report["validation"]["passed"]
    plain = Session(mamba, None, CFG).generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    g = Session(mamba, MtpHead(tmp_path / "head", CFG), CFG, k=3).generate(PROMPT, max_new_tokens=30,
                                                                           ignore_eos=True)
    assert g.token_ids == plain.token_ids


def test_a_rerun_reuses_the_target_outputs_and_a_changed_corpus_does_not(llama, corpus, tmp_path, monkeypatch,
                                                                         capsys):
    from rlxrt.app import teacher

    out = tmp_path / "head"
    first = _train(llama, corpus, out, "--draft-vocab", "64")
    assert (out / ".train" / teacher.CACHE).is_file()
    passes, real = [], teacher.teacher
    monkeypatch.setattr(teacher, "teacher", lambda *a, **k: passes.append(1) or real(*a, **k))
    args = ["train-head", str(llama), "--corpus", str(corpus), "--out", str(out), "--steps", "60", "--batch", "4",
            "--max-tokens", "6000", "--threads", "1", "--draft-vocab", "64"]
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    assert passes == [] and "are reused" in capsys.readouterr().err  # the target did not run again
    again = json.loads((out / "train_report.json").read_text())
    assert again["heldout"] == first["heldout"]
    assert again["heldout_acceptance_per_position"] == first["heldout_acceptance_per_position"]
    assert main(args[:-1] + ["32", "--steps", "5", "--quiet"]) == 0  # another draft vocabulary: computed afresh
    assert len(passes) == 2
    assert main(args[:-1] + ["32", "--steps", "5", "--mlp-size", "64", "--resume"]) == 1  # another shape
    assert "--mlp-size" in capsys.readouterr().err


def test_more_text_reuses_the_windows_the_cache_holds(llama, corpus, tmp_path, monkeypatch, capsys):
    """A run over more of the corpus (another key) sends only the new windows through the target, plus the one
    whose logits the output-layer fit needs; its cache equals the one a fresh run writes."""
    from rlxrt.app import teacher
    from rlxrt.sessions.fused import FusedKVModel

    def run(out, max_tokens, *extra):
        assert main(["train-head", str(llama), "--corpus", str(corpus), "--out", str(out), "--steps", "5",
                     "--batch", "4", "--max-tokens", str(max_tokens), "--threads", "1", *extra]) == 0

    run(tmp_path / "head", 6000, "--quiet")
    windows, real = [], FusedKVModel.forward
    monkeypatch.setattr(FusedKVModel, "forward",
                        lambda self, t, *a, **k: windows.append(len(t) == teacher.WINDOW) or real(self, t, *a, **k))
    capsys.readouterr()
    run(tmp_path / "head", 9000)
    assert "windows of an earlier run with the same target are reused" in capsys.readouterr().err
    assert sum(windows) == 9000 // teacher.WINDOW - 6000 // teacher.WINDOW + 1
    monkeypatch.setattr(FusedKVModel, "forward", real)
    run(tmp_path / "fresh", 9000, "--quiet")
    with np.load(tmp_path / "head" / ".train" / teacher.CACHE) as a, \
            np.load(tmp_path / "fresh" / ".train" / teacher.CACHE) as b:
        for name in ("key", "tokens", "hidden", "lse", "held_hidden", "held_lse", "fit_h", "fit_l"):
            assert np.array_equal(a[name], b[name]), name
    other = teacher.target_digest(tmp_path / "head" / "rlxrt.json")  # the head's manifest: another model
    assert teacher.known_windows(tmp_path / "head" / ".train", other) == {}


def test_eval_prompts_measure_the_head_on_chat_requests(exported, corpus, tmp_path):
    """`--eval-prompts FILE`: the finished head is also measured on these requests, each a user turn through
    the target's chat template, and the report's figures are what a Session with the head gives on them."""
    from test_chat import CHATML

    from rlxrt.sessions import MtpHead, Session

    model = exported("llama", seed=3, chat_template=CHATML, with_hidden=True)
    requests = ["def add(a, b):", "Write a loop.", "class Stack:"]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    assert main(["train-head", str(model), "--corpus", str(corpus), "--out", str(tmp_path / "head"), "--steps", "5",
                 "--batch", "2", "--max-tokens", "3000", "--threads", "1", "--quiet",
                 "--eval-prompts", str(tmp_path / "requests.json")]) == 0
    report = json.loads((tmp_path / "head" / "train_report.json").read_text())
    assert report["eval_prompts"] == 3 and report["eval_measured_with"].startswith("greedy, k=4, chat requests")
    session = Session(model, MtpHead(tmp_path / "head", CFG), CFG, k=4)
    drafted, accepted = np.zeros(4), np.zeros(4)
    for text in requests:
        stats = session.chat([{"role": "user", "content": text}], max_new_tokens=128).stats
        drafted[:len(stats.drafted_per_position)] += stats.drafted_per_position
        accepted[:len(stats.accepted_per_position)] += stats.accepted_per_position
    assert drafted[0] > 0
    assert report["eval_acceptance_per_position"] == [round(float(a / d), 4) if d else 0.0
                                                      for a, d in zip(accepted, drafted)]


def test_an_attention_head_trains_and_stays_exact(llama, corpus, tmp_path):
    """--attention-heads: the head reads every position's hidden state into its cache; greedy equal and the
    sampled first two tokens follow the target (a sampled round rejects often, so commits cut the cache)."""
    from lossless import assert_first_two_tokens_follow, two_token_marginals

    from rlxrt.backends import compile
    from rlxrt.manifest import Manifest
    from rlxrt.sessions import MtpHead, Session
    from rlxrt.sessions.state import decoder_for

    out = tmp_path / "head"
    report = _train(llama, corpus, out, "--draft-vocab", "64", "--attention-heads", "4")
    m = Manifest.load(out)
    assert report["validation"]["passed"] and m.draft_head["attention_heads"] == 4 and m.kv_cache.kv_heads == 4
    plain = Session(llama, None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    g = Session(llama, MtpHead(out, CFG), CFG, k=4).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert g.token_ids == plain.token_ids and g.stats.drafted > 0
    prompt = [5, 17, 42, 9]
    p1, p2 = two_token_marginals(decoder_for(compile(llama, CFG)), prompt, SamplingParams(temperature=1.0))
    s = Session(llama, MtpHead(out, CFG), CFG, k=2)
    assert_first_two_tokens_follow(s, prompt, p1, p2, draws=4000)
    assert s.stats.accepted > 0


def test_train_head_usage_errors(exported, corpus, tmp_path, capsys):
    no_hidden = exported("llama")
    assert main(["train-head", str(no_hidden), "--corpus", str(corpus), "--out", str(tmp_path / "h")]) == 2
    assert "--with-hidden-states" in capsys.readouterr().err
    one = tmp_path / "one.txt"
    one.write_text("just one document")
    assert main(["train-head", str(exported("llama", with_hidden=True)), "--corpus", str(one),
                 "--out", str(tmp_path / "h")]) == 1
    assert "at least 2" in capsys.readouterr().err
    assert main(["train-head", str(no_hidden), "--corpus", str(corpus), "--out", str(tmp_path / "h"),
                 "--steps", "0"]) == 1
    assert main(["train-head", str(exported("llama", with_hidden=True)), "--corpus", str(corpus),
                 "--out", str(tmp_path / "h2"), "--steps", "5", "--resume", "--quiet"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train-head", str(exported("llama", with_hidden=True)), "--corpus", str(corpus),
                 "--out", str(tmp_path / "h4"), "--steps", "5", "--attention-heads", "3", "--quiet"]) == 2
    assert "--attention-heads 3 must divide the target's hidden size 64" in capsys.readouterr().err
    assert main(["train-head", str(exported("llama", with_hidden=True)), "--corpus", str(corpus),
                 "--out", str(tmp_path / "h3"), "--eval-prompts", str(tmp_path / "missing.json")]) == 1
    assert "--eval-prompts" in capsys.readouterr().err and not (tmp_path / "h3").exists()  # before the target ran


def test_fit_summary_advises_more_text_when_the_head_overfits():
    from rlxrt.exporters.head_train import fit_summary

    log = [{"step": i, "agree1": 0.74} for i in range(1, 100)] + [{"step": 100, "agree1": 0.76,
                                                                    "heldout": {"agree1": 0.56}}]
    fit = fit_summary(log)
    assert fit["train_agree1"] == 0.7404 and fit["heldout_agree1"] == 0.56 and "more text" in fit["advice"]
    log[-1]["heldout"]["agree1"] = 0.70  # within the gap: no advice
    assert "advice" not in fit_summary(log)
    assert fit_summary([]) == {"train_agree1": None, "heldout_agree1": None}
