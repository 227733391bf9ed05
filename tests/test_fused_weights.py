"""The shipped float32 fused graphs read back into their weights and built again: the same graph in float32
(bit for bit), and float16 graphs for GPUs, which a GPU config's shipped pair is, built on first use."""
import numpy as np
import pytest

import rlxrt
from rlxrt import Config, ExportError, Manifest
from rlxrt.app.reference import reference_head, reference_pair
from rlxrt.exporters.fused_weights import rebuild
from rlxrt.sessions import DraftModel, MtpHead, PromptLookup, Session, decoder_for

TARGET, DRAFT = reference_pair()
IDS = list(range(5, 70))


@pytest.mark.parametrize("kernels", ["ort", "rlxrt"])
def test_a_float32_rebuild_is_the_same_graph(tmp_path, kernels):
    cfg = Config(intra_op_threads=1, cache=False, cpu_kernels=kernels)
    for model in (TARGET, DRAFT):
        out = tmp_path / model.name
        m = rebuild(model, out, "float32")
        assert m.source["weights_sha256"] == Manifest.load(model).source["weights_sha256"]
        a, b = (decoder_for(rlxrt.compile(p, cfg)) for p in (model, out))
        assert np.array_equal(a.forward(IDS), b.forward(IDS))


def test_the_float16_pair_speculates_exactly_and_the_shipped_head_binds(tmp_path):
    config = Config(providers=("cuda", "cpu"), cache_dir=str(tmp_path / "cache"))
    target, draft = reference_pair(config)  # a GPU config: the float16 graphs, built once into its cache
    assert target.parent == tmp_path / "cache" / f"reference-float16-{rlxrt.__version__}"
    assert reference_pair(config) == (target, draft)
    m = Manifest.load(target)
    assert m.dtype == "float16" and m.kv_cache.dtype == "float16" and m.outputs["hidden_states"]
    assert m.source["weights_sha256"] == Manifest.load(TARGET).source["weights_sha256"]
    cpu = Config(intra_op_threads=1, cache=False, fixed_rows=5)  # here on the CPU, in its fixed-rows form
    fp32 = decoder_for(rlxrt.compile(TARGET, cpu)).forward(IDS)
    fp16 = decoder_for(rlxrt.compile(target, cpu)).forward(IDS)
    assert np.abs(fp32 - fp16).max() < 0.05 and (fp32.argmax(-1) == fp16.argmax(-1)).mean() > 0.95
    graph = rlxrt.compile(target, cpu)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    plain = Session(graph, None, cpu).generate(prompt, max_new_tokens=48, ignore_eos=True).token_ids
    for spec in (DraftModel(draft, cpu), PromptLookup(), MtpHead(reference_head(), cpu)):
        got = Session(graph, spec, cpu, k=4).generate(prompt, max_new_tokens=48, ignore_eos=True)
        assert got.token_ids == plain and got.stats.accepted > 0, type(spec).__name__


def test_what_it_cannot_read_back_is_refused(exported, tmp_path):
    src = exported.source("llama", seed=4, init=0.02)
    for kwargs in (dict(graph="portable"), dict(quantize="int8")):
        out = rlxrt.export(src, tmp_path / next(iter(kwargs.values())), **kwargs).path
        with pytest.raises(ExportError, match="export it again from its source"):
            rebuild(out, tmp_path / "again", "float16")
