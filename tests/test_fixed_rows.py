"""Fixed rows (``Config.fixed_rows``): every decoding call of the target feeds the same number of rows, so a
position's logits are computed by the same kernels whether it is a plain step's token or a verification's.

On ONNX Runtime's kernels a one-row step and a row of a (k+1)-row verification take different paths and differ
by ~1e-5 (the shipped target, below); with fixed rows a position's logits are bitwise the same in every row of
a call, which is what makes speculative output equal plain output by construction on kernels like those
(ONNX Runtime's on GPUs, in half precision, where near-ties flip: docs/exactness.md).
"""
import numpy as np
import pytest

import rlxrt
from rlxrt import Config, ConfigError, GenerationError
from rlxrt.app.reference import reference_pair
from rlxrt.sessions import DraftModel, PromptLookup, Session, decoder_for

TARGET, DRAFT = reference_pair()
ORT = dict(intra_op_threads=1, cache=False, cpu_kernels="ort")
IDS = list(range(5, 80))


def rows_of(graph, rows: int, base: int = 40) -> dict:
    """Logits of position ``base + j`` for every j < rows, each as row j of a ``rows``-row call after ``base``
    positions, and as row 0 of a padded call (a plain step under fixed rows); and of position ``base`` in a
    one-row step. (Every call here writes the KV of its positions, so each starts from a cache the calls of
    ``rows`` rows wrote, as in a Session with fixed rows.)"""
    model = decoder_for(graph)
    model.forward(IDS[:base], rows=1)
    call = model.forward(IDS[base:base + rows]).copy()  # a verification: position base + j is row j
    out = {"in_call": call, "padded": []}
    for j in range(rows):
        model.commit(base + j)
        out["padded"].append(model.forward([IDS[base + j]] * rows)[0].copy())  # the real token, then padding
        model.commit(base + j + 1)
        model.forward(IDS[base + j + 1:base + j + 1 + rows])  # the KV of base + j as a call of `rows` writes it
    model.commit(base)
    out["one_row"] = model.forward(IDS[base:base + 1])[0].copy()
    return out


@pytest.mark.parametrize("rows", [3, 5, 9])
def test_a_position_is_computed_alike_in_every_row_of_a_fixed_call(rows):
    got = rows_of(rlxrt.compile(TARGET, Config(**ORT)), rows)
    for j in range(rows):
        assert np.array_equal(got["in_call"][j], got["padded"][j]), (rows, j)
    # what fixed rows are for: a one-row step is not computed as a row of a larger call
    assert np.abs(got["in_call"][0] - got["one_row"]).max() > 0


@pytest.mark.export
@pytest.mark.parametrize("variant", [dict(graph="portable"), dict(graph="fused", dtype="fp16")])
def test_fixed_rows_hold_on_other_graphs(exported, tmp_path, variant):
    src = exported.source("llama", seed=4, init=0.02)
    out = rlxrt.export(src, tmp_path / "m", **variant).path
    got = rows_of(rlxrt.compile(out, Config(**ORT)), 5, base=20)
    for j in range(5):
        assert np.array_equal(got["in_call"][j], got["padded"][j]), j


@pytest.mark.parametrize("kernels", ["ort", "rlxrt"])
def test_speculative_equals_plain_under_fixed_rows(kernels):
    cfg = Config(intra_op_threads=1, cache=False, cpu_kernels=kernels, fixed_rows=9)
    graph, draft = rlxrt.compile(TARGET, cfg), rlxrt.compile(DRAFT, cfg)
    prompts = ["def add(a, b):\n", "import os\nimport sys\n\nclass Stack:\n"]
    plain = Session(graph, None, cfg)
    assert plain.rows == 9
    want = [plain.generate(p, max_new_tokens=96, ignore_eos=True).token_ids for p in prompts]
    for make in (lambda: DraftModel(draft), PromptLookup):
        for k in (1, 4, 8):
            s = Session(graph, make(), cfg, k=k)
            assert [s.generate(p, max_new_tokens=96, ignore_eos=True).token_ids for p in prompts] == want
            assert s.stats.drafted > s.stats.accepted > 0
    sampled = Session(graph, DraftModel(draft), cfg, k=4).generate(prompts[0], max_new_tokens=32, temperature=0.8,
                                                                   seed=3)
    assert len(sampled.token_ids) == 32


def test_fixed_rows_bounds_k_and_the_context():
    cfg = Config(intra_op_threads=1, cache=False, fixed_rows=5)
    graph = rlxrt.compile(TARGET, cfg)
    with pytest.raises(GenerationError, match="fixed rows.*k <= 4.*fixed_rows = 9"):
        Session(graph, PromptLookup(), cfg, k=8)
    s = Session(graph, PromptLookup(), cfg, k=4, adaptive_k=True)
    assert s.k_max == 4  # the default ceiling stays inside the rows
    with pytest.raises(GenerationError, match="k=6"):
        s.generate("x", k=6)
    long = Session(graph, PromptLookup(), cfg, k=4)  # a request to the end of the context ends by length
    capacity = long.manifest.max_positions
    g = long.generate([5] * (capacity - 40), max_new_tokens=100, ignore_eos=True)
    assert g.finish_reason == "length" and len(g.prompt_token_ids) + len(g.token_ids) == capacity - 4
    with pytest.raises(ConfigError, match="fixed_rows.*got 1"):
        Config(fixed_rows=1)
    with pytest.raises(ConfigError, match="fixed_rows"):
        Config(fixed_rows=34)
    assert Session(rlxrt.compile(TARGET, Config(intra_op_threads=1, cache=False))).rows == 0  # auto on the CPU
