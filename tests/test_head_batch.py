"""The batched MTP head graph (backends/head_batch.py, stream_scan.h) on the shipped SmolLM2 head: each
sequence computed as the one-sequence head computes it, and bitwise the same whatever the other sequences of
the call, with rollbacks of different lengths per slot; and Sessions drafting on a HeadBatch
(sessions/head_batch.py) with the shipped pair's head: each request as alone, a failed step failing its request
alone."""
import dataclasses
import gc
from pathlib import Path

import numpy as np
import pytest

import rlxrt
from rlxrt.app.reference import reference_pair
from rlxrt.backends import compile, head_batch
from rlxrt.config import Config
from rlxrt.errors import GenerationError, ProviderError
from rlxrt.sessions import Batch, Cascade, Driver, HeadBatch, MtpHead, PromptLookup, Session, StateModel
from rlxrt.sessions.batch import Slot

HEAD = Path(rlxrt.__file__).parent / "assets" / "smollm2" / "head"
FLAT = Path(rlxrt.__file__).parent / "assets" / "reference" / "mtp"
CFG = Config(intra_op_threads=1)
SLOTS, CAPACITY, R, H = 3, 128, 256, 576


class Calls:
    """The batched head's graph with KV buffers of SLOTS slots, run on numpy inputs."""

    def __init__(self):
        import onnxruntime as ort

        self.graph = compile(HEAD, CFG, batched=True)
        shape = [SLOTS, 9, CAPACITY, 64]
        self.kv = [ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, "cpu", 0) for _ in range(2)]

    def __call__(self, *parts):
        """parts: (slot, first position, ids, hidden rows, start state); -> logits, hidden_out, states."""
        b = self.graph.session.io_binding()
        for buf, past, present in zip(self.kv, ("past_key.0", "past_value.0"), ("present_key.0", "present_value.0")):
            b.bind_ortvalue_input(past, buf)
            b.bind_ortvalue_output(present, buf)
        counts = [len(p[2]) for p in parts]
        feeds = {"input_ids": np.concatenate([p[2] for p in parts])[None].astype(np.int64),
                 "hidden_states": np.concatenate([p[3] for p in parts])[None].astype(np.float32),
                 "state": np.stack([p[4] for p in parts]).astype(np.float32),
                 "sequences": np.array([(p[0], p[1], c) for p, c in zip(parts, counts)], np.int32),
                 "last_rows": (np.cumsum(counts) - 1).astype(np.int64)}
        for name, array in feeds.items():
            b.bind_cpu_input(name, array)
        for name in ("logits", "hidden_out", "states"):
            b.bind_output(name)
        self.graph.session.run_with_iobinding(b)
        return [o.numpy() for o in b.get_outputs()[2:]]


@pytest.fixture(scope="module")
def calls():
    return Calls()


@pytest.fixture(scope="module")
def text():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 49152, 60), rng.standard_normal((60, H)).astype(np.float32)) for _ in range(3)]


def test_each_sequence_is_computed_as_the_one_sequence_head_computes_it(calls, text):
    ids, hidden = text[0]
    one = StateModel(compile(HEAD, CFG))
    zero = np.zeros(R, np.float32)
    logits, own, states = calls((0, 0, ids[:20], hidden[:20], zero))
    expected = one.forward(ids[:20], hidden[:20])[0]
    np.testing.assert_allclose(states, np.stack([one.state(i + 1)[0] for i in range(20)]), atol=1e-5)
    assert logits.shape == (1, 1, 8192) and own.shape == (1, 1, H)
    assert logits[0, 0].argmax() == expected.argmax()
    assert np.abs(logits[0, 0] - expected).max() < 0.02 * np.abs(expected).max()  # int8 activations, two builds
    for t in range(20, 24):  # chained one row at a time, each on the head's own hidden state
        logits, own, states = calls((0, t, ids[t:t + 1], own[0], states[-1]))
        expected = one.forward(ids[t:t + 1], one.hidden)[0]
        assert logits[0, 0].argmax() == expected.argmax()
        np.testing.assert_allclose(states[0], one.state()[0], atol=1e-5)


def test_a_sequences_rows_are_bitwise_the_same_beside_any_others(calls, text):
    (a, ha), (b, hb), (c, hc) = text
    zero = np.zeros(R, np.float32)
    alone = [calls((0, 0, a[:20], ha[:20], zero))]
    alone.append(calls((0, 20, a[20:23], ha[20:23], alone[0][2][-1])))
    alone.append(calls((0, 18, a[18:19], ha[18:19], alone[0][2][-3])))  # rolled back to 18 tokens
    calls((1, 0, b[:40], hb[:40], zero))
    calls((2, 0, c[:9], hc[:9], zero))
    first = calls((2, 9, c[9:10], hc[9:10], zero + 0.25), (0, 0, a[:20], ha[:20], zero), (1, 30, b[30:35],
                                                                                          hb[30:35], zero))
    second = calls((1, 12, b[12:13], hb[12:13], zero), (0, 20, a[20:23], ha[20:23], first[2][20]))
    third = calls((0, 18, a[18:19], ha[18:19], first[2][18]), (2, 3, c[3:4], hc[3:4], zero))
    beside = [(first[0][:, 1:2], first[1][:, 1:2], first[2][1:21]), (second[0][:, 1:], second[1][:, 1:],
                                                                       second[2][1:]),
              (third[0][:, :1], third[1][:, :1], third[2][:1])]
    for got, want in zip(beside, alone):
        for g, w in zip(got, want):
            assert np.array_equal(g, w)


def test_a_head_the_batch_cannot_run_is_refused_with_the_reason():
    m = rlxrt.Manifest.load(HEAD)
    assert head_batch.refusal(m) is None
    assert head_batch.refusal(rlxrt.Manifest.load(FLAT)) is None  # no attention layer: one hidden row a sequence
    cacheless = dataclasses.replace(m, kv_cache=None)
    assert "no one-layer cache" in head_batch.refusal(cacheless)
    streams = dataclasses.replace(m, draft_head={**m.draft_head, "hidden_layers": [3, 7]})
    assert "residual streams" in head_batch.refusal(streams)
    with pytest.raises(ProviderError, match="rlxrt's CPU kernels"):
        compile(HEAD, Config(intra_op_threads=1, cpu_kernels="ort"), batched=True)


# -- the head's batch under Sessions ----------------------------------------------------------------------------
TARGET = str(reference_pair()[0])
KCFG = Config(intra_op_threads=1, cache=False, cpu_kernels="rlxrt")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n    return"


def every_round_drafts(monkeypatch):
    """Each round drafts the k its Session wants (the batch's plan and guard bypassed), so that Sessions that
    draft meet in the head's steps."""
    def k_cap(self, wanted, ks=None):
        self.caps = [wanted if ks is None else min(wanted, k) for k in (ks or [wanted] * len(self.caps))]
        self._asked = True
        return max(self.caps, default=0)

    monkeypatch.setattr(Slot, "k_cap", k_cap)


def _speculator(i, heads):
    head = MtpHead(heads, KCFG)
    return head if i % 2 else Cascade(PromptLookup(min_n=3), head)


def test_driven_sessions_on_a_head_batch_equal_their_lone_runs_and_share_its_steps(monkeypatch):
    """Six requests (greedy and seeded sampled, the head alone and behind prompt lookup) as tasks of a driver,
    joining and leaving while others decode, each drafting with a slot of one HeadBatch: each equals its run
    alone on a batch of one, the greedy ones plain greedy, and the head's steps held several sequences."""
    every_round_drafts(monkeypatch)
    requests = [(CODE + " " * i, dict(max_new_tokens=24 + 8 * (i % 3), ignore_eos=True,
                                     **({"temperature": 0.8, "seed": i} if i % 3 == 2 else {}))) for i in range(6)]
    lone = {}
    for i, (prompt, kw) in enumerate(requests):
        session = Session(Batch(TARGET, KCFG, slots=1, calibrate=False), _speculator(i, HeadBatch(FLAT, KCFG, slots=1)),
                          KCFG, k=3)
        lone[i] = session.generate(prompt, **kw).token_ids
    plain = Session(TARGET, None, KCFG)
    for i, (prompt, kw) in enumerate(requests):
        if "seed" not in kw:
            assert lone[i] == plain.generate(prompt, **kw).token_ids
    batch = Batch(TARGET, KCFG, slots=4, chunk=16, calibrate=False)
    heads = HeadBatch(FLAT, KCFG, slots=4, chunk=16)
    driver, got = Driver(), {}

    def task(i):
        session = Session(batch, _speculator(i, heads), KCFG, k=3)
        got[i] = session.generate(requests[i][0], **requests[i][1]).token_ids
        if i + 3 < len(requests):
            driver.spawn(task, i + 3)  # joins beside the running ones

    try:
        for i in range(3):
            driver.spawn(task, i)
        driver.run()
    finally:
        driver.close()
    assert got == lone
    assert heads.calls > heads.steps > 0  # the drafting Sessions' calls ran together


def test_a_failed_head_step_fails_its_request_and_the_head_batch_serves_on(monkeypatch):
    every_round_drafts(monkeypatch)
    heads = HeadBatch(FLAT, KCFG, slots=1)
    session = Session(Batch(TARGET, KCFG, slots=1, calibrate=False), MtpHead(heads, KCFG), KCFG, k=2)
    real = heads.graph.session.run_with_iobinding

    def fails(binding):
        raise heads.graph.errors[0]("injected fault")

    monkeypatch.setattr(heads.graph.session, "run_with_iobinding", fails)
    with pytest.raises(GenerationError, match="batched head"):
        session.generate(CODE, max_new_tokens=12, ignore_eos=True)
    monkeypatch.setattr(heads.graph.session, "run_with_iobinding", real)
    plain = Session(TARGET, None, KCFG).generate(CODE, max_new_tokens=12, ignore_eos=True).token_ids
    assert session.generate(CODE, max_new_tokens=12, ignore_eos=True).token_ids == plain


def test_a_head_batch_refuses_a_lone_target_and_a_slot_too_many():
    heads = HeadBatch(FLAT, KCFG, slots=1)
    with pytest.raises(GenerationError, match="slot of a Batch"):
        Session(TARGET, MtpHead(heads, KCFG), KCFG)
    held = MtpHead(heads, KCFG)
    with pytest.raises(GenerationError, match="all 1 slots"):
        MtpHead(heads, KCFG)
    del held
    gc.collect()
    MtpHead(heads, KCFG)  # the slot came back with the speculator that held it


def test_sessions_on_their_own_threads_share_a_head_batch_as_driven_ones_do(monkeypatch):
    """Without a driver each Session runs on its own thread and the hand-in that completes a head step runs it:
    every output equals its lone run, and the head's steps held several sequences."""
    import threading

    every_round_drafts(monkeypatch)
    prompts = [CODE + " " * i for i in range(3)]
    plain = Session(TARGET, None, KCFG)
    lone = [plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    batch = Batch(TARGET, KCFG, slots=3, calibrate=False, gather_seconds=30.0)  # steps wait for all
    heads = HeadBatch(FLAT, KCFG, slots=3)
    sessions = [Session(batch, MtpHead(heads, KCFG), KCFG, k=3) for _ in prompts]
    got = [None] * 3

    def run(i):
        got[i] = sessions[i].generate(prompts[i], max_new_tokens=24, ignore_eos=True).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == lone
    assert heads.calls > heads.steps > 0


def test_a_greedy_chain_stays_in_the_head_batchs_steps(monkeypatch):
    """A greedy proposal hands in once and its k - 1 chained tokens run in the steps after, without its Session
    between them; a sampled one hands in every token. Output is plain greedy's either way."""
    every_round_drafts(monkeypatch)
    heads = HeadBatch(FLAT, KCFG, slots=1)
    hand_ins = []
    submit = HeadBatch.submit
    monkeypatch.setattr(HeadBatch, "submit", lambda self, *a: (hand_ins.append(1), submit(self, *a))[1])
    session = Session(Batch(TARGET, KCFG, slots=1, calibrate=False), MtpHead(heads, KCFG), KCFG, k=3)
    g = session.generate(CODE, max_new_tokens=24, ignore_eos=True)
    assert g.token_ids == Session(TARGET, None, KCFG).generate(CODE, max_new_tokens=24, ignore_eos=True).token_ids
    assert 0 < len(hand_ins) <= g.stats.rounds  # one hand-in a drafting round, at most
    assert heads.steps >= 2 * len(hand_ins)  # and its chain's steps after it (k = 3: three steps a proposal)
    hand_ins.clear()
    steps = heads.steps
    session.generate(CODE, max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=1)
    assert len(hand_ins) == heads.steps - steps  # sampled: a hand-in a step
