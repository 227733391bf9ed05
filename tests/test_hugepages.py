"""Huge pages for a CPU session's weights: the pure parts with a fake libc, then the real kernel on the
shipped target (whichever way this kernel answers, the state must say so truthfully)."""
import ctypes
import platform
import sys


from rlxrt import Config, compile
from rlxrt.app.reference import reference_pair, reference_prompts
from rlxrt.backends.hugepages import CHUNK, MADV_COLLAPSE, HugePages, collapse_new, runs

MIB = 1 << 20


class FakeLibc:
    def __init__(self, answer: int):
        self.answer, self.calls = answer, []

    def madvise(self, start, length, advice):
        self.calls.append((start, length, advice))
        if self.answer:
            ctypes.set_errno(self.answer)
            return -1
        return 0


def test_adjacent_chunks_are_collapsed_in_one_call_per_run():
    chunks = {10 * CHUNK, 11 * CHUNK, 12 * CHUNK, 20 * CHUNK}
    assert runs(chunks) == [(10 * CHUNK, 13 * CHUNK), (20 * CHUNK, 21 * CHUNK)]
    libc = FakeLibc(0)
    pages = HugePages("collapsing", frozenset(chunks), libc).start()
    assert pages.wait(10) == "on: 8 MiB" and pages.mib == 8
    assert libc.calls == [(10 * CHUNK, 3 * CHUNK, MADV_COLLAPSE), (20 * CHUNK, CHUNK, MADV_COLLAPSE)]


def test_a_refusing_kernel_is_a_state_not_an_error():
    pages = HugePages("collapsing", frozenset({4 * CHUNK}), FakeLibc(22)).start()
    assert pages.wait(10).startswith("off: the kernel refused MADV_COLLAPSE (errno 22)")
    assert pages.mib == 0


class RefusesOneChunk(FakeLibc):
    def madvise(self, start, length, advice):
        self.calls.append((start, length, advice))
        if start <= 11 * CHUNK < start + length:
            ctypes.set_errno(11)
            return -1
        return 0


def test_a_refused_chunk_does_not_cost_the_rest_of_its_run():
    libc = RefusesOneChunk(0)
    pages = HugePages("collapsing", frozenset({10 * CHUNK, 11 * CHUNK, 12 * CHUNK}), libc).start()
    assert pages.wait(10) == "on: 4 MiB"
    assert libc.calls[0] == (10 * CHUNK, 3 * CHUNK, MADV_COLLAPSE) and len(libc.calls) == 4


def test_without_mincore_nothing_is_tried():
    assert collapse_new(None).state == "off: needs Linux (mincore, madvise)"


def test_config_turns_it_off(monkeypatch):
    target, _ = reference_pair()
    monkeypatch.setenv("RLXRT_HUGE_PAGES", "0")
    from rlxrt import load_config

    config = load_config().with_overrides(intra_op_threads=1, cache=False)
    assert config.huge_pages is False
    graph = compile(target, config)
    assert graph.huge_pages.wait() == "off: huge_pages = false in config"
    assert graph.to_dict()["huge_pages"] == graph.huge_pages.state


def _kernel_collapses() -> bool:
    """Linux 6.1+ with transparent huge pages not turned off: MADV_COLLAPSE must work there."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            if "[never]" in fh.read():
                return False
    except OSError:
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


FRESH = """
import json
from rlxrt import Config, compile
from rlxrt.app.reference import reference_pair
graph = compile(reference_pair()[0], Config(intra_op_threads=1, cache=False, cpu_kernels="ort"))
state = graph.huge_pages.wait(60)
with open("/proc/self/smaps_rollup") as fh:
    anon = next(int(line.split()[1]) for line in fh if line.startswith("AnonHugePages:"))
print(json.dumps({"state": state, "mib": graph.huge_pages.mib, "anon_kib": anon}))
"""
"""The collapse in a fresh process: in the test process, memory that earlier tests freed is reused by the
allocator, already resident, so the weights' chunks are not new ones and are rightly left alone."""


def test_the_weights_move_onto_huge_pages_and_decoding_is_unchanged():
    import json
    import subprocess

    from rlxrt.sessions import Session

    target, _ = reference_pair()
    prompt = reference_prompts()[0]
    # ONNX Runtime's own MatMul packs the weights into anonymous memory, the memory this is about (rlxrt's
    # kernel reads them where the graph file is mapped)
    plain = Session(compile(target, Config(intra_op_threads=1, cache=False, huge_pages=False, cpu_kernels="ort")))
    expected = plain.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
    graph = compile(target, Config(intra_op_threads=1, cache=False, cpu_kernels="ort"))
    # decoding while the collapse may still be under way, then after it
    during = Session(graph).generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
    state = graph.huge_pages.wait(60)
    after = Session(graph).generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
    assert during == expected and after == expected
    if _kernel_collapses():
        weights = sum(f.stat().st_size for f in target.glob("*.data"))
        fresh = json.loads(subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True,
                                          check=True).stdout.strip().splitlines()[-1])
        assert fresh["state"].startswith("on: "), fresh
        # the packed weights (a chunk may be refused where memory is fragmented, not half of them)
        assert fresh["mib"] * MIB >= weights // 2, fresh
        assert fresh["anon_kib"] * 1024 >= fresh["mib"] * MIB
        assert state.startswith("on: ") or state.startswith("off: the load added no"), state
    else:
        assert state.startswith("off: the kernel refused") or state == "off: needs Linux (mincore, madvise)"
