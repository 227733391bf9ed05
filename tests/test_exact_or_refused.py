"""Exact or refused, for every export variant: graph kind x dtype x quantisation x kernel set, on two model
shapes (one whose MLP width is a multiple of 32, one that is not, as the shipped target's 688 is not).

For each variant the test compiles the export on both kernel sets and, for a draft model and prompt lookup at
k = 1 and 4, asserts that speculative greedy output equals the same graph's plain greedy output, or that the
Session refused the speculator with a typed error naming why; an export rlxrt does not make is refused at
export with a typed error. The classification itself is asserted too (``EXPECTED``), so that refusing
everything could not pass.
"""
import pytest

import rlxrt
from rlxrt import Config, ExportError, GenerationError
from rlxrt.backends import cpu_kernels
from rlxrt.sessions import DraftModel, PromptLookup, Session

pytestmark = pytest.mark.export

SHAPES = {"aligned": None, "mlp-88": 88}
"""The MLP width of each shape (None: 2 x hidden = 128)."""
VARIANTS = {  # name: export arguments
    "fused-fp32": dict(graph="fused"),
    "fused-fp16": dict(graph="fused", dtype="fp16"),
    "fused-int8": dict(graph="fused", quantize="int8"),
    "fused-int4": dict(graph="fused", quantize="int4"),
    "fused-int4-int8-compute": dict(graph="fused", quantize="int4", int4_compute="int8"),
    "portable-fp32": dict(graph="portable"),
    "portable-fp16": dict(graph="portable", dtype="fp16"),
    "portable-int8": dict(graph="portable", quantize="int8"),
    "portable-int4": dict(graph="portable", quantize="int4"),
}
EXPECTED = {  # (variant, kernel set) -> "exact" | "refused" | "export refused"; the same on both shapes
    **{(v, ks): "exact" for v in ("fused-fp32", "fused-fp16", "fused-int4", "portable-fp32", "portable-fp16")
       for ks in ("rlxrt", "ort")},
    ("fused-int8", "rlxrt"): "exact", ("fused-int8", "ort"): "refused",
    ("fused-int4-int8-compute", "rlxrt"): "exact", ("fused-int4-int8-compute", "ort"): "refused",
    ("portable-int8", "rlxrt"): "refused", ("portable-int8", "ort"): "refused",
    ("portable-int4", "rlxrt"): "export refused", ("portable-int4", "ort"): "export refused",
}
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"
TOKENS = 24


@pytest.fixture(scope="module")
def exports(exported, tmp_path_factory):
    """{(shape, variant): model directory or the ExportError}, and the draft (an fp32 fused llama)."""
    root = tmp_path_factory.mktemp("variants")
    out = {}
    for shape, width in SHAPES.items():
        src = exported.source("llama", seed=4, init=0.02, **({"intermediate": width} if width else {}))
        for name, kwargs in VARIANTS.items():
            try:
                out[shape, name] = rlxrt.export(src, root / f"{shape}-{name}", **kwargs).path
            except ExportError as exc:
                out[shape, name] = exc
    return out, exported("llama", seed=9, layers=1, init=0.02)


def outcome(target, draft, kernels: str) -> tuple[str, str]:
    cfg = Config(intra_op_threads=1, cache=False, cpu_kernels=kernels)
    graph = rlxrt.compile(target, cfg)
    plain = Session(graph, None, cfg).generate(PROMPT, max_new_tokens=TOKENS, ignore_eos=True).token_ids
    results = set()
    for make in (lambda: DraftModel(draft, cfg), PromptLookup):
        for k in (1, 4):
            try:
                session = Session(graph, make(), cfg, k=k)
            except GenerationError as exc:
                assert "cannot be speculated over exactly" in str(exc), str(exc)
                results.add(("refused", str(exc)))
                continue
            got = session.generate(PROMPT, max_new_tokens=TOKENS, ignore_eos=True)
            assert got.token_ids == plain, (target.name, kernels, type(session.speculator).__name__, k)
            assert got.stats.drafted > 0
            results.add(("exact", ""))
    assert len(results) == 1, results  # a variant is refused by every speculator or by none
    return results.pop()


@pytest.mark.skipif(cpu_kernels.library() is None, reason="rlxrt's kernel library was not built")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_variant_is_exact_or_refused(exports, shape):
    made, draft = exports
    table = {}
    for name in VARIANTS:
        target = made[shape, name]
        for kernels in ("rlxrt", "ort"):
            if isinstance(target, ExportError):
                assert "fused graph only" in str(target), str(target)
                table[name, kernels] = "export refused"
                continue
            kind, why = outcome(target, draft, kernels)
            table[name, kernels] = kind
            if kind == "refused" and kernels == "ort" and name.startswith("fused-int"):
                assert "cpu_kernels = rlxrt" in why, why  # the fix named works: rlxrt's kernels are exact on it
            if name == "portable-int8":
                assert "dynamically" in why and "cpu_kernels = rlxrt" not in why, why
    assert table == EXPECTED, {key: (table[key], EXPECTED[key]) for key in table if table[key] != EXPECTED[key]}


if __name__ == "__main__":  # the matrix for the record: python tests/test_exact_or_refused.py
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import _Exports

    root = Path(tempfile.mkdtemp())
    made = _Exports(root)
    draft = made("llama", seed=9, layers=1, init=0.02)
    print("| shape | variant | kernels | outcome |\n| --- | --- | --- | --- |")
    for shape, width in SHAPES.items():
        src = made.source("llama", seed=4, init=0.02, **({"intermediate": width} if width else {}))
        for name, kwargs in VARIANTS.items():
            try:
                target = rlxrt.export(src, root / f"{shape}-{name}", **kwargs).path
            except ExportError as exc:
                print(f"| {shape} | {name} | both | export refused: {exc} |")
                continue
            for kernels in ("rlxrt", "ort"):
                kind, why = outcome(target, draft, kernels)
                print(f"| {shape} | {name} | {kernels} | {kind}{': ' + why.split(': ', 1)[1][:160] if why else ''} |")
