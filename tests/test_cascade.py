"""Cascade: prompt lookup first, a model behind it, on real exported graphs (a random-init Llama target with
hidden states, a random MTP head, another Llama as draft model): greedy exactness with both sources drafting,
sampled losslessness, requests in a row, bad compositions."""
import pytest

from rlxrt import Config
from rlxrt.backends import compile
from rlxrt.errors import GenerationError
from rlxrt.sampling import SamplingParams
from rlxrt.sessions import Cascade, DraftModel, MtpHead, PromptLookup, Session, decoder_for

from lossless import assert_first_two_tokens_follow, two_token_marginals
from test_mtp import head, target  # noqa: F401  (the same target and head fixtures)

pytestmark = pytest.mark.export
CFG = Config(intra_op_threads=1, cache=False)
PROMPT = [5, 17, 42, 9, 61, 5, 17, 42, 9, 61, 5, 17]  # lookup proposes at once


@pytest.fixture(scope="module")
def plain(target):
    return Session(target, None, CFG).generate(PROMPT, max_new_tokens=48, ignore_eos=True).token_ids


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("behind", ["mtp", "draft"])
def test_greedy_with_lookup_then_a_model_equals_plain_greedy(exported, target, head, plain, k, behind):
    model = MtpHead(head, CFG) if behind == "mtp" else DraftModel(exported("llama", seed=1), CFG)
    spec = Cascade(PromptLookup(min_n=2), model)
    s = Session(target, spec, CFG, k=k)
    g = s.generate(PROMPT, max_new_tokens=48, ignore_eos=True)
    assert g.token_ids == plain
    assert spec.proposed_by[0] > 0 and spec.proposed_by[1] > 0  # both sources drafted, in turns
    assert g.stats.speculator == f"prompt-lookup+{model.name}" and g.stats.providers["draft"] == ["cpu"]
    # the model behind lookup kept following the text: a second request is exact too, and so is another prompt
    assert s.generate(PROMPT, max_new_tokens=48, ignore_eos=True).token_ids == plain
    other = Session(target, None, CFG).generate("class Point:\n", max_new_tokens=30, ignore_eos=True).token_ids
    assert s.generate("class Point:\n", max_new_tokens=30, ignore_eos=True).token_ids == other


@pytest.mark.parametrize("prompt, source", [([5, 17, 9, 5, 17], 0), ([5, 17, 42, 9], 1)],
                         ids=["lookup-drafts", "head-drafts"])
def test_sampled_output_through_a_cascade_has_the_targets_distribution(target, head, prompt, source):
    """Two-token requests draft once, so each prompt tests one source: lookup finds (5, 17) in the first, nothing
    in the second, where the head drafts."""
    p1, p2 = two_token_marginals(decoder_for(compile(target, CFG)), prompt, SamplingParams(temperature=1.0))
    spec = Cascade(PromptLookup(min_n=2), MtpHead(head, CFG))
    s = Session(target, spec, CFG, k=2)
    assert_first_two_tokens_follow(s, prompt, p1, p2, draws=3000)
    assert spec.proposed_by[source] == 3000 and spec.proposed_by[1 - source] == 0 and s.stats.accepted > 0


def test_bad_cascades_are_clear_errors(target, head):
    with pytest.raises(GenerationError, match="two or more speculators"):
        Cascade(PromptLookup())
    with pytest.raises(GenerationError, match="two or more speculators"):
        Cascade(PromptLookup(), "mtp")
    for ks, words in (((2,), "one k per source"), ("22", "one k per source"), ((2, 0), "source's k must be an integer"),
                      ((2, 1.5), "source's k must be an integer")):
        with pytest.raises(GenerationError, match=words):
            Cascade(PromptLookup(), PromptLookup(min_n=2), ks=ks)
    head_spec = MtpHead(head, CFG)
    first = Session(target, head_spec, CFG)
    taken = Cascade(PromptLookup(), head_spec)
    with pytest.raises(GenerationError, match="already serves another Session"):  # its head is taken
        Session(target, taken, CFG)
    Session(target, taken.sources[0], CFG)  # the refused cascade let go of the lookup it had attached
    lookup = PromptLookup()
    second = Session(target, Cascade(lookup, MtpHead(head, CFG)), CFG)
    with pytest.raises(GenerationError, match="already serves another Session"):
        Session(target, lookup, CFG)
    assert first.speculator is head_spec and second.speculator.sources[0] is lookup


def test_each_source_drafts_at_most_its_own_k(target, head, plain):
    spec = Cascade(PromptLookup(min_n=2), MtpHead(head, CFG), ks=(6, 1))
    s = Session(target, spec, CFG)
    assert s.k == 6
    g = s.generate(PROMPT, max_new_tokens=48, ignore_eos=True)
    assert g.token_ids == plain and spec.proposed_by[1] > 0
    assert len(g.stats.drafted_per_position) <= 6
    head_only = Cascade(PromptLookup(min_n=64, max_n=64), MtpHead(head, CFG), ks=(6, 1))  # never a 64-token match
    g = Session(target, head_only, CFG).generate(PROMPT, max_new_tokens=48, ignore_eos=True)
    assert g.token_ids == plain and len(g.stats.drafted_per_position) == 1
    assert head_only.proposed_by[0] == 0 and head_only.proposed_by[1] > 0


def test_cli_and_server_options_build_a_cascade(exported, target, head):
    import json
    import subprocess
    import sys

    from rlxrt.app.serve.options import ServeOptions
    from rlxrt.errors import UsageError

    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    want = Session(target, None, CFG).generate(text, max_new_tokens=40, ignore_eos=True).token_ids

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "rlxrt", "generate", "--target", str(target), "--prompt", text,
                               *args], capture_output=True, text=True, timeout=300)

    r = cli("--speculator", "lookup+mtp", "--head", str(head), "--max-new-tokens", "40", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == want and out["stats"]["speculator"] == "prompt-lookup+mtp-head"
    r = cli("--speculator", "lookup+draft")
    assert r.returncode == 2 and "--speculator lookup+draft needs --draft DIR" in r.stderr
    r = cli("--speculator", "lookup+draft", "--head", str(head))
    assert r.returncode == 2 and "exclude each other" in r.stderr
    with pytest.raises(UsageError, match="needs --head DIR"):
        ServeOptions(target=str(target), speculator="lookup+mtp")
    assert ServeOptions(target=str(target), speculator="lookup+mtp", draft=str(head)).speculator == "lookup+mtp"
