"""The shipped reference pair: it loads from the installed package, is exact, and the demo runs."""
import os
import subprocess
import sys

from rlxrt import Config, Manifest
from rlxrt.app.reference import REFERENCE, reference_pair, reference_prompts

ENV = {k: v for k, v in os.environ.items() if not k.startswith("RLXRT_")}


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
        st = spec.stats  # the time split covers decoding only, prefill apart
        assert 0.0 <= st.python_overhead_share < 0.5 and st.draft_seconds + st.target_seconds <= st.decode_seconds


def test_demo_runs_end_to_end():
    code = "import sys; sys.modules['torch'] = None\nfrom rlxrt.app.cli import main\nsys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "demo", "--max-new-tokens", "24", "--repeats", "1"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "output identical to plain greedy decoding: yes" in r.stdout
    assert "tok/s" in r.stdout and "acceptance" in r.stdout


def test_shipped_mtp_head_is_exact_and_agrees_often():
    from rlxrt.app.reference import reference_head
    from rlxrt.sessions import MtpHead, Session

    head = reference_head()
    assert head is not None and Manifest.load(head).validation["passed"]
    target, _ = reference_pair()
    assert Manifest.load(target).outputs["hidden_states"] == "hidden_states"
    assert Manifest.load(head).draft_head["target"]["weights_sha256"] == Manifest.load(target).source["weights_sha256"]
    cfg = Config(intra_op_threads=1, cache=False)
    prompt = reference_prompts()[2]
    plain = Session(target, None, cfg).generate(prompt, max_new_tokens=48, ignore_eos=True)
    for k in (1, 3, 5):
        g = Session(target, MtpHead(head, cfg), cfg, k=k).generate(prompt, max_new_tokens=48, ignore_eos=True)
        assert g.token_ids == plain.token_ids
        assert g.stats.bonus > 0  # trained: full acceptances happen (and commit after them)
        if k == 1:
            assert g.stats.acceptance_rate > 0.5  # the first proposal agrees with the target most of the time


def test_generate_cli_with_the_shipped_mtp_head():
    import json

    target, _ = reference_pair()
    code = "import sys; sys.modules['torch'] = None\nfrom rlxrt.app.cli import main\nsys.exit(main(sys.argv[1:]))"
    args = ["generate", "--target", str(target), "--speculator", "mtp", "--prompt", "def read(path):",
            "--max-new-tokens", "16", "--ignore-eos", "--json"]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 16 and out["stats"]["speculator"] == "mtp-head"
    plain = subprocess.run([sys.executable, "-c", code, *args[:3], "--prompt", "def read(path):",
                            "--max-new-tokens", "16", "--ignore-eos", "--json"],
                           capture_output=True, text=True, env=ENV, timeout=300)
    assert json.loads(plain.stdout)["token_ids"] == out["token_ids"]
