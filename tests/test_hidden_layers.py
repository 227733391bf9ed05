"""`rlxrt export --hidden-layers`: the fused graph's hidden_states output goes on with the residual stream after
chosen layers (validated against transformers' hidden_states), and `rlxrt train-head` trains a head that reads
them (EAGLE-3's low, middle and high features): it exports, binds only to a target that outputs the same
layers, and greedy speculation with it equals plain decoding."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rlxrt.app.cli import main
from rlxrt.config import Config
from rlxrt.errors import ExportError, GenerationError, ModelFormatError

pytestmark = pytest.mark.export
CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def layered(exported, tmp_path_factory):
    """A 4-layer llama exported with the residual streams after layers 1 and 2 (``auto`` for 4 layers)."""
    import rlxrt

    out = tmp_path_factory.mktemp("layered") / "target"
    rlxrt.export(exported.source("llama", layers=4), out, hidden_layers="auto")
    return out


def test_export_appends_the_residual_streams(layered, exported):
    import torch
    from transformers import AutoModelForCausalLM

    from rlxrt.backends import compile
    from rlxrt.manifest import Manifest
    from rlxrt.sessions.state import decoder_for

    m = Manifest.load(layered)
    assert m.hidden_layers == (1, 2) and m.outputs["hidden_states"] == "hidden_states"
    v = m.validation
    assert v["passed"] and v["max_abs_diff_hidden"] < 1e-4 and v["max_rel_diff_residuals"] < 1e-4
    model = decoder_for(compile(layered, CFG))
    assert model.fetch_hidden() == 3 * 64
    ids = [5, 17, 42, 9, 33, 2]
    model.forward(np.array(ids))
    got = np.asarray(model.hidden).reshape(len(ids), -1)
    hf = AutoModelForCausalLM.from_pretrained(exported.source("llama", layers=4)).eval()
    with torch.no_grad():
        ref = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    want = np.concatenate([ref.last_hidden_state[0], ref.hidden_states[1][0], ref.hidden_states[2][0]], -1)
    assert np.abs(got - want).max() < 1e-4


def test_hidden_layers_refusals(exported, tmp_path, capsys):
    import rlxrt

    src = exported.source("llama", layers=4)
    for layers, message in (([0, 2], "each in 1..3"), ([4], "each in 1..3"), ([2, 1], "ascending"),
                            ([1, 1], "distinct")):
        with pytest.raises(ExportError, match="--hidden-layers") as e:
            rlxrt.export(src, tmp_path / "x", hidden_layers=layers)
        assert "distinct layer counts in ascending order" in str(e.value) and "e.g. 1,2" in str(e.value), message
    with pytest.raises(ExportError, match="fused graph"):
        rlxrt.export(src, tmp_path / "x", hidden_layers=[1], graph="portable")
    with pytest.raises(ExportError, match="a list of layer counts or 'auto'"):
        rlxrt.export(src, tmp_path / "x", hidden_layers="1,2")
    assert not (tmp_path / "x").exists()
    assert main(["export", str(src), str(tmp_path / "y"), "--hidden-layers", "one"]) == 2
    assert "--hidden-layers takes comma-separated layer counts" in capsys.readouterr().err


def test_inspect_names_the_streams(layered, capsys):
    assert main(["inspect", str(layered)]) == 0
    out = capsys.readouterr().out
    assert "hidden_states also holds the residual streams after layers [1, 2]" in out and "[1, 'sequence', 192]" in out


def test_manifest_checks_hidden_layers(layered):
    from rlxrt.manifest import Manifest

    good = Manifest.load(layered).to_dict()
    for value in ([4], [0], [2, 1], "1", [1.0], [True]):
        with pytest.raises(ModelFormatError, match="'hidden_layers' must be a list of distinct layer counts"):
            Manifest.from_dict({**good, "hidden_layers": value})
    with pytest.raises(ModelFormatError, match="'outputs.hidden_states' is absent"):
        Manifest.from_dict({**good, "outputs": {**good["outputs"], "hidden_states": None}})
    assert Manifest.from_dict({k: v for k, v in good.items() if k != "hidden_layers"}).hidden_layers == ()


def test_a_head_reading_the_streams_trains_binds_and_stays_exact(layered, exported, tmp_path, capsys):
    from hf_models import CORPUS

    from rlxrt.manifest import Manifest
    from rlxrt.sessions import MtpHead, Session

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    lines = [line for text in CORPUS for line in text.splitlines()] * 6
    for i in range(12):
        rng.shuffle(lines)
        (corpus / f"doc{i:02d}.py").write_text("\n".join(lines) + "\n")
    out = tmp_path / "head"
    assert main(["train-head", str(layered), "--corpus", str(corpus), "--out", str(out), "--steps", "60",
                 "--batch", "4", "--max-tokens", "6000", "--threads", "1", "--draft-vocab", "64"]) == 0
    assert "residual streams after layers 1, 2" in capsys.readouterr().err
    log = [json.loads(line) for line in (out / ".train" / "log.jsonl").read_text().splitlines()]
    assert np.mean([r["loss"] for r in log[-10:]]) < 0.9 * np.mean([r["loss"] for r in log[:10]])
    report = json.loads((out / "train_report.json").read_text())
    assert report["validation"]["passed"] and report["output_rows_error"] < 1e-4
    m = Manifest.load(out)
    assert m.draft_head["hidden_layers"] == [1, 2] and m.draft_head["hidden_size"] == 3 * 64

    plain = Session(layered, None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    for k in (1, 3):
        g = Session(layered, MtpHead(out, CFG), CFG, k=k).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
        assert g.token_ids == plain.token_ids and g.stats.drafted > 0
    with pytest.raises(GenerationError, match="re-export the target with --hidden-layers 1,2"):
        Session(exported("llama", with_hidden=True, layers=4), MtpHead(out, CFG), CFG)  # same weights, no streams


def test_a_head_of_the_last_state_alone_reads_those_columns_of_a_layered_target(layered, exported, tmp_path):
    """A head trained without the streams binds to a target that outputs them and drafts exactly as it does on
    the same weights exported without them: it reads the LM head's input, the first H columns."""
    from test_mtp import make_head

    from rlxrt.sessions import MtpHead, Session

    last_only = exported("llama", with_hidden=True, layers=4)
    head = make_head(last_only, exported.source("llama", layers=4), tmp_path / "head")
    plain = Session(layered, None, CFG).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    heads = [MtpHead(head, CFG), MtpHead(head, CFG)]
    runs = [Session(t, h, CFG, k=3).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
            for t, h in zip((last_only, layered), heads)]
    assert runs[0].token_ids == runs[1].token_ids == plain.token_ids
    assert runs[0].stats.drafted > 0
    assert heads[1].last.shape == heads[0].last.shape == (1, 64)
    np.testing.assert_allclose(heads[1].last, heads[0].last, atol=1e-5)
    for field in ("drafted_per_position", "accepted_per_position"):  # the same proposals, the same acceptance
        assert getattr(runs[0].stats, field) == getattr(runs[1].stats, field)
