"""An MTP head with a causal self-attention layer (``train-head --attention-heads``) on real exported graphs:
its cache after every commit holds exactly what the target computed, and speculation with it stays exact."""
import numpy as np
import pytest

import rlxrt
from rlxrt.config import Config
from rlxrt.errors import ProviderError
from rlxrt.backends import compile
from rlxrt.sampling import SamplingParams
from rlxrt.speculator import AcceptDecision, Context, Prefill, VerifyResult
from rlxrt.sessions import MtpHead, Session, StateModel, decoder_for

from test_mtp import CFG, PROMPT, make_head

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def target(exported):
    return exported("llama", seed=0, with_hidden=True)


@pytest.fixture(scope="module")
def attn_head(exported, target, tmp_path_factory):
    return make_head(target, exported.source("llama", seed=0), tmp_path_factory.mktemp("mtp") / "attn",
                     attention_heads=4)


@pytest.fixture(scope="module")
def plain(exported):
    return Session(exported("llama", seed=0), None, CFG).generate(PROMPT, max_new_tokens=40,
                                                                  ignore_eos=True).token_ids


def test_the_head_declares_its_cache_and_is_validated_against_torch(attn_head):
    m = rlxrt.Manifest.load(attn_head)
    assert m.draft_head["attention_heads"] == 4
    kv = m.kv_cache
    assert (kv.layers, kv.kv_heads, kv.head_dim, kv.names(0)) == \
        (1, 4, 16, ("past_key.0", "past_value.0", "present_key.0", "present_value.0"))
    assert m.validation["passed"] and m.validation["max_abs_diff"] < 1e-4  # prefill and a step from its cache


def reference_logits(head_dir, tokens, hidden):
    """The head's first proposal for a context read in one call with the target's own hidden states."""
    return StateModel(compile(head_dir, CFG)).forward(tokens, hidden)


def _prefilled(target, attn_head, rng):
    """A target and the head bound to it, after a random 9-token prompt; ``first`` collects each of the head's
    calls' logits."""
    tgt = decoder_for(compile(target, CFG))
    spec = MtpHead(attn_head, CFG)
    spec.bind(tgt)
    ctx = Context(tokens=rng.integers(3, tgt.vocab_size, 9).tolist(), params=SamplingParams(),
                  rng=np.random.default_rng(0))
    tgt.forward(ctx.tokens[:-1])
    spec.prefill(ctx, Prefill(hidden=tgt.hidden))
    first = []
    forward = spec.model.forward
    spec.model.forward = lambda *a: first.append(forward(*a)) or first[-1]
    return tgt, spec, ctx, first


@pytest.mark.parametrize("k", [1, 3, 5])
def test_after_each_commit_the_next_proposal_equals_reading_the_context_with_the_targets_hidden_states(
        target, attn_head, k):
    """Forced accept patterns j = 0..k: the chained drafts wrote the head's own hidden states into its cache,
    and a commit must leave only the target's."""
    rng = np.random.default_rng(k)
    tgt, spec, ctx, first = _prefilled(target, attn_head, rng)
    patterns = list(range(k + 1)) * 2
    rng.shuffle(patterns)
    for j in patterns:
        ref = decoder_for(compile(target, CFG))
        ref.fetch_hidden()
        ref.forward(ctx.tokens[:-1])
        n = len(ctx.tokens)
        want = reference_logits(attn_head, ctx.tokens[1:], ref.hidden[:n - 1])
        first.clear()
        drafted = spec.propose(ctx, k).tokens
        np.testing.assert_allclose(first[0], want, atol=1e-4)
        assert len(drafted) == k and spec.model.kv.cache[0].shape[2] == spec.model.length == n - 1 + k - 1
        logits = tgt.forward([ctx.tokens[-1], *drafted])
        new = np.append(drafted[:j], rng.integers(3, tgt.vocab_size))
        ctx.tokens.extend(new.tolist())
        tgt.commit(len(ctx.tokens) - 1)
        spec.commit(ctx, AcceptDecision(j, new.astype(np.int64), bonus=j == k), VerifyResult(logits, hidden=tgt.hidden))
        assert spec.model.length == n - 1 and len(spec.last) == j + 1  # the verified rows wait for the next round


def test_rounds_that_draft_nothing_keep_the_rows_the_head_has_still_to_read(target, attn_head):
    """A batch's plan under load drafts nothing for a while (k = 0: no proposal, one target row a round). The
    rows of those rounds, and of the round before them, wait for the head's next proposal, which must read them
    as the target computed them, however often the target's calls rewrote its buffer since."""
    rng = np.random.default_rng(7)
    tgt, spec, ctx, first = _prefilled(target, attn_head, rng)
    for k in (0, 0, 3, 0, 0, 0, 2, 0, 3):
        drafted = np.zeros(0, np.int64)
        if k:
            ref = decoder_for(compile(target, CFG))
            ref.fetch_hidden()
            ref.forward(ctx.tokens[:-1])
            want = reference_logits(attn_head, ctx.tokens[1:], ref.hidden[:len(ctx.tokens) - 1])
            first.clear()
            drafted = spec.propose(ctx, k).tokens
            np.testing.assert_allclose(first[0], want, atol=1e-4)
        logits = tgt.forward([ctx.tokens[-1], *drafted])
        j = int(rng.integers(0, len(drafted) + 1))
        new = np.append(drafted[:j], rng.integers(3, tgt.vocab_size))
        ctx.tokens.extend(new.tolist())
        tgt.commit(len(ctx.tokens) - 1)
        spec.commit(ctx, AcceptDecision(j, new.astype(np.int64), bonus=j == len(drafted)),
                    VerifyResult(logits, hidden=tgt.hidden))


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_an_attention_head_equals_plain_greedy(target, attn_head, plain, k):
    g = Session(target, MtpHead(attn_head, CFG), CFG, k=k).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert g.token_ids == plain and g.stats.drafted > 0


def test_one_token_prompts_and_requests_in_a_row(target, attn_head, exported):
    s = Session(target, MtpHead(attn_head, CFG), CFG, k=3)
    plain = Session(exported("llama", seed=0), None, CFG)
    for prompt in ([7], "class Point:\n", [7]):
        assert s.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids == \
            plain.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids


@pytest.fixture(scope="module")
def int8_head(exported, target, tmp_path_factory):
    return make_head(target, exported.source("llama", seed=0), tmp_path_factory.mktemp("mtp") / "attn8",
                     attention_heads=4, quantize="int8")


def test_an_attention_head_on_a_head_batch_drafts_beside_others_as_alone(target, attn_head, int8_head, monkeypatch):
    """Three Sessions on one Batch, drafting with slots of one HeadBatch of the attention head (its keys and
    values in slot buffers, each slot rolled back by its own length), as tasks of a driver, every round drafting:
    greedy output equals plain greedy, a seeded request its run alone on a batch of one, and the head's steps
    held several sequences."""
    from rlxrt.sessions import Batch, Driver, HeadBatch

    from test_head_batch import every_round_drafts

    every_round_drafts(monkeypatch)
    cfg = Config(intra_op_threads=1, cache=False, cpu_kernels="rlxrt")  # what a batch runs
    requests = [dict(max_new_tokens=40, ignore_eos=True), dict(max_new_tokens=32, temperature=0.8, seed=3),
                dict(max_new_tokens=40, ignore_eos=True)]
    plain = Session(target, None, cfg).generate(PROMPT, **requests[0]).token_ids
    alone = Session(Batch(target, cfg, slots=1, calibrate=False), MtpHead(HeadBatch(int8_head, cfg, slots=1), cfg),
                    cfg, k=3).generate(PROMPT, **requests[1]).token_ids
    batch, heads = Batch(target, cfg, slots=3, calibrate=False), HeadBatch(int8_head, cfg, slots=3)
    driver, got = Driver(), {}

    def task(i):
        got[i] = Session(batch, MtpHead(heads, cfg), cfg, k=3).generate(PROMPT, **requests[i]).token_ids

    try:
        for i in range(3):
            driver.spawn(task, i)
        driver.run()
    finally:
        driver.close()
    assert got == {0: plain, 1: alone, 2: plain}
    assert heads.calls > heads.steps > 0
    with pytest.raises(ProviderError, match="int8 or int4 head"):  # a float head's MatMuls are not rlxrt's
        HeadBatch(attn_head, cfg, slots=1)
