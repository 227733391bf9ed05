"""rlxrt bench and rlxrt demo as commands (no speed assertions), and the shipped reference pair."""
import json
import os
import subprocess
import sys

import pytest

from rlxrt import Config, Manifest
from rlxrt.assets import REFERENCE, reference_pair, reference_prompts

ENV = {k: v for k, v in os.environ.items() if not k.startswith("RLXRT_")}


def rlxrt(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "rlxrt", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


@pytest.mark.export
def test_bench_on_a_tiny_random_pair_writes_json_and_png(exported, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["def add(a, b):\n    return", "for i in range(3):\n"]))
    r = rlxrt("bench", "--target", str(exported("llama")), "--draft", str(exported("llama", seed=1)),
              "--prompt-file", str(prompts), "--prompts", "2", "--repeats", "1", "--max-new-tokens", "6",
              "--ks", "1,2", "--hf-target", str(exported.source("llama")),
              "--hf-draft", str(exported.source("llama", seed=1)), "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "b" / "bench.json").read_text())
    rows = data["temperatures"]["0.0"]
    assert set(rows) == {"plain", "draft k=1", "draft k=2", "draft adaptive", "prompt lookup k=4", "hf plain",
                         "hf assisted"}
    assert rows["plain"]["speedup"] == 1.0 and rows["draft k=2"]["tokens_per_s"] > 0
    assert 0 <= rows["draft k=2"]["acceptance_rate"] <= 1 and "efficiency" in rows["draft k=2"]
    assert set(rows["draft k=1"]["time_split"]) == {"draft", "target", "other"}
    assert {"target_1", "draft_1", "target_2", "target_3"} <= set(data["step_times_s"])
    png = (tmp_path / "b" / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "temperature 0.7" in r.stdout and "hf assisted" in r.stdout


def test_shipped_pair_loads_and_manifests_validate():
    target, draft = reference_pair()
    assert str(target).startswith(str(REFERENCE))
    for d in (target, draft):
        m = Manifest.load(d)
        assert m.validation["passed"] and m.tokenizer == "tokenizer.json"
    assert Manifest.load(target).vocab_size == Manifest.load(draft).vocab_size
    assert len(reference_prompts()) >= 8
    total = sum(f.stat().st_size for f in REFERENCE.rglob("*") if f.is_file())
    assert total < 40e6


def test_shipped_pair_speculative_greedy_equals_plain():
    from rlxrt.sessions import DraftModel, Session

    cfg = Config(intra_op_threads=1, cache=False)
    target, draft = reference_pair()
    prompt = reference_prompts()[1]
    plain = Session(target, None, cfg).generate(prompt, max_new_tokens=48, ignore_eos=True)
    for k in (2, 5):
        spec = Session(target, DraftModel(draft, cfg), cfg, k=k).generate(prompt, max_new_tokens=48,
                                                                          ignore_eos=True)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.acceptance_rate > 0.3  # a trained pair agrees often


def test_demo_runs_end_to_end():
    code = "import sys; sys.modules['torch'] = None\nfrom rlxrt.cli import main\nsys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "demo", "--max-new-tokens", "24", "--repeats", "1"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "output identical to plain greedy decoding: yes" in r.stdout
    assert "tok/s" in r.stdout and "acceptance" in r.stdout
