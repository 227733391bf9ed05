"""rlxrt bench as a command on a tiny random pair (no speed assertions)."""
import json
import os
import subprocess
import sys

import pytest

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
    assert {"target_1", "draft_1", "target_2", "target_3", "draft_round"} <= set(data["step_times_s"])
    assert data["step_times_s"]["draft_round"] > 0
    png = (tmp_path / "b" / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "temperature 0.7" in r.stdout and "hf assisted" in r.stdout


@pytest.mark.export
def test_bench_of_a_target_with_a_greedy_head_reports_it(exported, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["def add(a, b):\n    return", "for i in range(3):\n"]))
    r = rlxrt("bench", "--target", str(exported("llama", greedy_head=True)), "--no-hf", "--no-head",
              "--prompt-file", str(prompts), "--prompts", "2", "--repeats", "1", "--max-new-tokens", "8", "--ks", "2", "--temperatures", "0",
              "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "b" / "bench.json").read_text())
    head = data["greedy_head"]
    assert head["rows"] >= 2 * 8 and 0 <= head["fallback_rows"] <= head["rows"]
    assert {"target_ids_1", "target_ids_3"} <= set(data["step_times_s"])
    assert "greedy head:" in r.stdout and "T(k+1)/T(1), greedy ids: T(3)/T(1)" in r.stdout


@pytest.mark.export
def test_bench_runs_another_draft_beside_the_draft(exported, tmp_path):
    """--other-draft: the same draft in int8 gets rows of its own in the same loop, named by its dtype (its
    exactness: tests/test_fused.py); without --draft it is a usage error."""
    from rlxrt import UsageError
    from rlxrt.app.bench import run_bench

    import rlxrt as api

    q8 = tmp_path / "q8"
    api.export(exported.source("llama", seed=1), q8, quantize="int8")
    prompts = ["def add(a, b):\n    return", "for i in range(3):\n"]
    res = run_bench(exported("llama"), exported("llama", seed=1), prompts, max_new_tokens=8, repeats=1,
                    temperatures=(0.0,), ks=(2,), progress=False, other_draft=q8)
    rows = res["temperatures"]["0.0"]
    assert {"draft k=2", "int8 draft k=2"} <= set(rows) and rows["int8 draft k=2"]["tokens_per_s"] > 0
    assert res["config"]["other_draft"] == "q8" and len(res["config"]["cpu_kernels"]) == 3
    with pytest.raises(UsageError, match="pass --draft"):
        run_bench(exported("llama"), None, prompts, repeats=1, temperatures=(0.0,), ks=(2,), progress=False,
                  other_draft=q8)


@pytest.mark.export
def test_bench_chat_sends_user_turns_and_stops_at_end_of_turn(exported, tmp_path):
    from test_chat import CHATML

    from rlxrt.app.bench import run_bench
    from rlxrt.backends import cpu_kernels
    from rlxrt.errors import UsageError

    model = exported("llama", seed=3, chat_template=CHATML)
    res = run_bench(model, None, ["def add(a, b):", "Write a loop."], max_new_tokens=12, repeats=1,
                    temperatures=(0.0,), ks=(2,), progress=False, chat=True)
    assert res["config"]["chat"] is True and res["config"]["min_prob"] == 0.0
    assert [state.split(":")[0] for state in res["config"]["cpu_kernels"]] == [  # the target's, said as compile did
        "on" if cpu_kernels.isa() in cpu_kernels.WINS_ON else "off"]
    assert set(res["temperatures"]["0.0"]) == {"plain", "prompt lookup k=4"}
    # the prompts went through the template: the requests' prompt lengths are those of the rendered turns
    from rlxrt.sessions import Session

    s = Session(model)
    lens = sorted(len(s.chat_prompt([{"role": "user", "content": p}])) for p in ["def add(a, b):", "Write a loop."])
    assert res["config"]["step_time_context"] == int((lens[0] + lens[1]) / 2 + 6)
    assert res["temperatures"]["0.0"]["plain"]["tokens_per_s"] > 0
    with pytest.raises(UsageError, match="no chat template"):
        run_bench(exported("llama"), None, ["x"], repeats=1, temperatures=(0.0,), ks=(2,), progress=False,
                  chat=True)


def test_smollm2_demo_builds_only_its_missing_target(tmp_path, monkeypatch, capsys):
    """Without SmolLM2's export the demo builds it, saying what and how long, and uses the committed head (the
    build itself is stopped here: it downloads from PyPI; tests/test_real_model.py builds it for real)."""
    from rlxrt.app import smollm2
    from rlxrt.app.cli import main
    from rlxrt.errors import RlxrtError

    asked = []

    def export(work, name, *flags):
        asked.append((work, name, flags))
        raise RlxrtError("stopped by the test")

    monkeypatch.setattr(smollm2, "_export", export)
    monkeypatch.setenv("RLXRT_SMOLLM2_DIR", str(tmp_path / "nothing-here"))
    assert main(["demo", "--model", "smollm2"]) == 1
    err = capsys.readouterr().err
    assert asked == [(tmp_path / "nothing-here", "target", ("--with-hidden-states",))]  # not the head's recipe
    assert "building SmolLM2-135M-Instruct" in err and "about 2 minutes" in err and "stopped by the test" in err
    assert main(["demo", "--model", "smollm2", "--target", str(tmp_path)]) == 2
    assert "holds no export" in capsys.readouterr().err
    assert main(["demo", "--model", "smollm2", "--draft", "x"]) == 2
    assert "drop --draft" in capsys.readouterr().err
    assert main(["demo", "--model", "smollm2", "--speculator", "lookup+draft"]) == 2
    assert "pass --speculator mtp or lookup+mtp, not 'lookup+draft'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["mtp", "lookup+mtp", "lookup+draft"])
def test_demo_speculators_on_the_shipped_pair(kind, capsys):
    """`rlxrt demo --speculator KIND` on the shipped pair and head: the reply equals plain greedy decoding;
    a cascade says which source drafted how many rounds."""
    from rlxrt.app.cli import main

    assert main(["demo", "--speculator", kind, "--max-new-tokens", "24", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "output identical to plain greedy decoding: yes" in out
    assert ("MTP head (drafts" in out) == kind.endswith("mtp")
    assert ("prompt lookup, else" in out and "rounds drafted by prompt lookup / the" in out) == ("lookup" in kind)


def test_smollm2_recipe_keeps_the_bench_prompts_out_of_the_self_written_requests(tmp_path, monkeypatch):
    """The recipe's wiring, its steps recorded instead of run: the corpus is written by the int4 export that
    computes with int8 activations, in two lanes side by side, in two phases; the self-written requests (and only
    they) exclude the held-out bench prompts, and the second phase's also the first phase's requests; the head
    trains on all the corpora; steps whose output exists are skipped."""
    from rlxrt.app import smollm2

    calls = []

    def export(work, name, *flags):
        calls.append(["export", name, *flags])
        (work / name).mkdir()
        (work / name / "rlxrt.json").write_text("{}")

    monkeypatch.setattr(smollm2, "_export", export)
    monkeypatch.setattr(smollm2, "_run", lambda cmd: calls.append(cmd[3:]))
    (tmp_path / "corpus.json").write_text("[]")
    smollm2.build(tmp_path / "demo-only")  # a head is committed: the target alone is built
    assert calls == [["export", "target", "--with-hidden-states"]]
    calls.clear()
    smollm2.build(tmp_path, train_head=True)
    assert calls[:2] == [["export", "target", "--with-hidden-states"],
                         ["export", "text", "--quantize", "int4", "--int4-compute", "int8"]]
    distills, train = calls[2:-1], calls[-1]
    assert len(distills) == 7 and all(c[:2] == ["distill", str(tmp_path / "text")] for c in distills)
    outs = {c[c.index("--out") + 1]: c for c in distills}
    first = ("self-a.json", "self-b.json", "self-c.json", "self-d.json")
    selves = (*first, "self-e.json", "self-f.json")
    assert sorted(outs) == sorted(str(tmp_path / n) for n in ("distill.json", *selves))
    seeds = [int(c[c.index("--seed") + 1]) for c in distills if "--self-prompts" in c]
    spans = sorted((s, s + int(c[c.index("--self-prompts") + 1]))  # try i draws with seed s + i
                   for s, c in zip(seeds, [c for c in distills if "--self-prompts" in c]))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"self-written runs share seeds: {spans}"
    for out, c in outs.items():
        assert ("--exclude" in c) == ("--self-prompts" in c) == (not out.endswith("distill.json"))
        assert c.count("--exclude") <= 1  # a second one would replace the first's files
    own = outs[str(tmp_path / "self-a.json")]
    held_out = own[own.index("--exclude") + 1]
    assert json.loads(open(held_out).read()) == smollm2.BENCH_PROMPTS and len(set(smollm2.BENCH_PROMPTS)) == 16
    earlier = [held_out, str(tmp_path / "distill-prompts.json"),
               *(str(tmp_path / n.replace(".json", "-prompts.json")) for n in first)]
    order = [c[c.index("--out") + 1] for c in distills]
    for late in ("self-e.json", "self-f.json"):
        c = outs[str(tmp_path / late)]
        assert c[c.index("--exclude") + 1:c.index("--out")] == earlier
        assert order.index(str(tmp_path / late)) > max(order.index(str(tmp_path / n)) for n in first)
    instructions = json.loads((tmp_path / "distill-prompts.json").read_text())
    assert len(instructions) > 400 and not set(smollm2.BENCH_PROMPTS) & set(instructions)
    assert train[:2] == ["train-head", str(tmp_path / "target")]
    assert train[train.index("--corpus") + 1:train.index("--out")] == [
        str(tmp_path / n) for n in ("distill.json", *selves, "corpus.json")]
    calls.clear()
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "rlxrt.json").write_text("{}")
    smollm2.build(tmp_path)
    assert calls == []


def test_bench_rows_of_two_heads_in_directories_of_the_same_name_stay_apart(tmp_path):
    """Two heads both in directories named ``mtp`` get a row each (they once shared one row, the last head's)."""
    import shutil
    from pathlib import Path

    from rlxrt.app.bench import head_labels

    shipped = Path(__file__).resolve().parents[1] / "rlxrt" / "assets" / "reference" / "mtp"
    for side in "ab":
        shutil.copytree(shipped, tmp_path / side / "mtp")
    assert head_labels([tmp_path / "a" / "mtp", tmp_path / "b" / "mtp"]) == ["a/mtp", "b/mtp"]
    assert head_labels([tmp_path / "a" / "mtp"] * 2) == ["mtp", "mtp#2"]
    r = rlxrt("bench", "--head", str(tmp_path / "a" / "mtp"), str(tmp_path / "b" / "mtp"), "--no-hf", "--prompts", "1",
              "--repeats", "1", "--max-new-tokens", "4", "--ks", "1", "--temperatures", "0", "--quiet",
              "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["temperatures"]["0.0"]
    assert {"mtp[a/mtp] k=1", "mtp[b/mtp] k=1", "lookup+mtp[a/mtp] k=1", "lookup+mtp[b/mtp] k=1"} <= set(rows)
