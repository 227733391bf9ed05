"""End to end on real exported random-init graphs: speculative greedy == plain greedy, token for token."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from rlxrt import Config
from rlxrt.sessions import Cascade, DraftModel, PromptLookup, Session
from rlxrt.speculator import DraftProposal, Speculator

pytestmark = pytest.mark.export
CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
N = 40


@pytest.fixture(scope="module")
def plain_outputs(exported):
    out = {}
    for fam in ("llama", "qwen2", "gpt2"):
        s = Session(exported(fam), None, CFG)
        out[fam] = s.generate(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("draft", ["self", "unrelated", "lookup"])
def test_greedy_speculative_equals_plain(exported, plain_outputs, family, k, draft):
    if draft == "self":
        spec = DraftModel(exported(family), CFG)
    elif draft == "unrelated":
        spec = DraftModel(exported(family, seed=1), CFG)
    else:
        spec = PromptLookup()
    s = Session(exported(family), spec, CFG, k=k)
    g = s.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    assert g.token_ids == plain_outputs[family]
    st = g.stats
    if draft == "self":
        assert st.acceptance_rate == 1.0 and st.rounds < N
    if draft == "unrelated":
        assert st.acceptance_rate < 0.5


def test_adaptive_k_is_exact_too(exported, plain_outputs):
    s = Session(exported("llama"), DraftModel(exported("llama", seed=1), CFG), CFG, k=2, adaptive_k=True)
    assert s.generate(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids == plain_outputs["llama"]
    s = Session(exported("llama"), DraftModel(exported("llama"), CFG), CFG, k=2, adaptive_k=True, k_max=8)
    g = s.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    assert g.token_ids == plain_outputs["llama"] and g.stats.acceptance_rate == 1.0


class Knows(Speculator):
    """Drafts a known continuation (shifted by ``wrong`` to make every draft a miss), at no cost."""

    name = "knows"

    def __init__(self, prompt_len: int, continuation: list[int], wrong: int = 0, vocab: int = 0):
        self.start, self.ids, self.wrong, self.vocab = prompt_len, continuation, wrong, vocab

    def propose(self, ctx, k):
        done = len(ctx.tokens) - self.start
        ids = self.ids[done:done + k]
        return DraftProposal(np.array([(t + self.wrong) % self.vocab for t in ids] if self.wrong else ids, np.int64))


class SlowlyWrong(Knows):
    """Every draft a miss, and each drafted token costs 10 ms: well above what a busy machine adds to a round
    (CI once saw a round that drafted 1 token take longer than the ones that drafted 2 at 2 ms a token)."""

    def propose(self, ctx, k):
        proposal = super().propose(ctx, k)
        time.sleep(10e-3 * len(proposal.tokens))
        return proposal


def test_adaptive_k_follows_what_rounds_earn(exported, plain_outputs):
    """Free drafts that are always right take k up (towards k_max); costly drafts that are always wrong take
    it to 1."""
    target = exported("llama")
    expected = plain_outputs["llama"]
    n_prompt = len(Session(target, None, CFG).prompt_ids(PROMPT))
    right = Session(target, Knows(n_prompt, expected), CFG, k=2, adaptive_k=True, k_max=8)
    g = right.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    assert g.token_ids == expected and g.stats.acceptance_rate == 1.0
    # timing noise on a tiny model may cost the last step or two to k_max, not more
    assert right._k_choice.k >= 5 and len(g.stats.drafted_per_position) >= 6
    capped = right.generate(PROMPT, max_new_tokens=N, ignore_eos=True, k=3)  # a request's k caps its rounds
    assert capped.token_ids == expected and len(capped.stats.drafted_per_position) == 3
    wrong = Session(target, SlowlyWrong(n_prompt, expected, 1, right.manifest.vocab_size), CFG, k=4, adaptive_k=True)
    g = wrong.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    assert g.token_ids == expected and g.stats.accepted == 0 and wrong._k_choice.k == 1


class SometimesKnows(Knows):
    """Drafts the known continuation every other round, nothing in between."""

    def propose(self, ctx, k):
        if (len(ctx.tokens) - self.start) % 2:
            return DraftProposal(np.zeros(0, np.int64))
        return super().propose(ctx, k)


def test_adaptive_k_keeps_a_k_per_cascade_source(exported, plain_outputs):
    """A cascade whose first source is always right (when it drafts) and whose second never is (and costs):
    the first source's k climbs (towards k_max), the second's falls to 1, and the output is the plain one."""
    target = exported("llama")
    expected = plain_outputs["llama"]
    s = Session(target, None, CFG)
    n_prompt, vocab = len(s.prompt_ids(PROMPT)), s.manifest.vocab_size
    spec = Cascade(SometimesKnows(n_prompt, expected), SlowlyWrong(n_prompt, expected, 1, vocab))
    s = Session(target, spec, CFG, k=2, adaptive_k=True, k_max=8)
    g = s.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    assert g.token_ids == expected and spec.proposed_by[0] > 0 and spec.proposed_by[1] > 0
    assert s._k_choice.ks[0] >= 5 and s._k_choice.ks[1] == 1


def test_sampled_same_seed_same_output(exported):
    s = Session(exported("qwen2"), DraftModel(exported("qwen2", seed=1), CFG), CFG, k=3)
    a = s.generate(PROMPT, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    b = s.generate(PROMPT, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_stop_string_spanning_tokens_inside_an_accepted_run(exported, plain_outputs):
    target = exported("llama")
    s = Session(target, DraftModel(target, CFG), CFG, k=8)  # every draft accepted: long runs
    full = s.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    codec = s.codec
    ends = [len(codec.decode(full.token_ids[:i + 1])) for i in range(N)]
    # a stop string from inside token 10's text into token 12's text
    i = next(j for j in range(8, N - 3) if ends[j] - ends[j - 1] >= 1 and ends[j + 2] - ends[j + 1] >= 1)
    start, end = ends[i] - 1, ends[i + 2]
    stop = full.text[start:end]
    assert full.text.find(stop) == start  # it first occurs there
    g = s.generate(PROMPT, max_new_tokens=N, ignore_eos=True, stop=[stop])
    assert g.finish_reason == "stop" and g.stop_reason == stop
    assert g.text == full.text[:start]
    assert g.token_ids == full.token_ids[:i + 3]
    pieces = list(s.stream(PROMPT, max_new_tokens=N, ignore_eos=True, stop=[stop]))
    assert "".join(pieces) == full.text[:start]


def test_stream_joins_to_generate_and_can_be_abandoned(exported):
    s = Session(exported("gpt2"), PromptLookup(), CFG)
    full = s.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    pieces = list(s.stream(PROMPT, max_new_tokens=N, ignore_eos=True))
    assert "".join(pieces) == full.text
    it = s.stream(PROMPT, max_new_tokens=N, ignore_eos=True)
    next(it)
    it.close()  # the caller breaks out
    assert s.last.finish_reason == "cancelled" and len(s.last.token_ids) < N
    assert s.generate(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids == full.token_ids


def test_multibyte_characters_are_never_split(exported):
    s = Session(exported("llama"), None, CFG)
    text = "Ünïcödé → 数学 ✓"
    ids = s.codec.encode(text)
    step = s.codec.decoder()
    pieces = [step(t) for t in ids]
    assert "".join(p for p in pieces if p) == text
    assert all("\ufffd" not in p for p in pieces if p)
    assert any(p is None for p in pieces)  # some tokens held back half a character


def test_cli_generate_json_and_stream(exported):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLXRT_")}
    base = [sys.executable, "-m", "rlxrt", "generate", "--target", str(exported("llama")), "--prompt", PROMPT,
            "--max-new-tokens", "12", "--ignore-eos", "--threads", "1"]
    r = subprocess.run(base + ["--draft", str(exported("llama", seed=1)), "-k", "3", "--json"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    plain = Session(exported("llama"), None, CFG).generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    assert data["token_ids"] == plain.token_ids and data["finish_reason"] == "length"
    assert data["stats"]["providers"] == {"target": ["cpu"], "draft": ["cpu"]}
    r = subprocess.run(base + ["--speculator", "prompt-lookup"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.rstrip("\n") == plain.text and "tok/s" in r.stderr
    r = subprocess.run(base + ["-k", "40", "--speculator", "prompt-lookup"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 1 and "1..32" in r.stderr and "Traceback" not in r.stderr
