"""Bad input, table-driven, across the Python API and every CLI command, on the shipped pair (real graphs).

Each case must end in a typed error (an ``RlxrtError`` subclass, or a usage error with exit code 2) whose
message names the offending value and what to do instead; after every API case the same Session still
reproduces its reference output exactly.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest

import rlxrt
from rlxrt import (Config, ConfigError, ExportError, GenerationError, ModelFormatError, RlxrtError, UsageError,
                   compile, load_config)
from rlxrt.app.cli import main
from rlxrt.app.reference import reference_head, reference_pair
from rlxrt.sessions import DraftModel, MtpHead, PromptLookup, Session

from conftest import link_or_copy

CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n    return"
TARGET, DRAFT = reference_pair()
HEAD = reference_head()


@pytest.fixture(scope="module")
def graph():
    return compile(TARGET, CFG)


@pytest.fixture(scope="module")
def session(graph):
    return Session(graph, PromptLookup(), CFG, k=3)


@pytest.fixture(scope="module")
def reference(session):
    return session.generate(PROMPT, max_new_tokens=16, ignore_eos=True).token_ids


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Malformed files for the file-reading cases."""
    d = tmp_path_factory.mktemp("bad")
    (d / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (d / "latin1.toml").write_bytes("intra_op_threads = 1 # caf\xe9\n".encode("latin-1"))
    (d / "broken.toml").write_text("intra_op_threads = = 1\n")
    (d / "a-dir").mkdir()
    (d / "empty-model").mkdir()
    (d / "empty-model" / "notes.txt").write_text("no model here")
    (d / "not-onnx.onnx").write_text("hello")
    (d / "bad.json").write_text("[1, 2")
    (d / "object.json").write_text('{"prompt": "x"}')
    (d / "numbers.json").write_text("[1]")
    (d / "hf-file").write_text("weights?")
    (d / "llama-config").mkdir()  # a config and no weights: enough for the checks made before any weight is read
    (d / "llama-config" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64}))
    return d


def model_dir(root: Path, name: str, edit=None, raw: bytes | None = None, source: Path = TARGET) -> Path:
    """A copy of a shipped model directory (files hard-linked where possible) with its manifest edited."""
    d = root / name
    d.mkdir()
    for f in source.iterdir():
        if f.name != "rlxrt.json":
            link_or_copy(f, d / f.name)
    if raw is not None:
        (d / "rlxrt.json").write_bytes(raw)
    else:
        data = json.loads((source / "rlxrt.json").read_text())
        edit(data)
        (d / "rlxrt.json").write_text(json.dumps(data))
    return d


# -- 1. requests on a live Session ------------------------------------------------------------------------------
V = "0..4095"
REQUESTS = [
    ({"k": 0}, ["got 0", "1..32"]), ({"k": 33}, ["33", "1..32"]), ({"k": 2.5}, ["2.5", "integer"]),
    ({"k": True}, ["True", "integer"]), ({"k": "4"}, ["'4'", "integer"]), ({"k": np.int64(0)}, ["0", "1..32"]),
    ({"max_new_tokens": 0}, ["max_new_tokens", "got 0", "1..1048576"]),
    ({"max_new_tokens": -5}, ["-5", "1..1048576"]), ({"max_new_tokens": 2 ** 21}, ["2097152", "1..1048576"]),
    ({"max_new_tokens": 1.5}, ["1.5", "integer"]), ({"max_new_tokens": "8"}, ["'8'", "integer"]),
    ({"max_new_tokens": None}, ["None", "integer"]),
    ({"temperature": -1}, ["temperature", "-1", ">= 0"]), ({"temperature": math.nan}, ["temperature", "nan"]),
    ({"temperature": math.inf}, ["temperature", "inf"]), ({"temperature": "hot"}, ["'hot'", "number"]),
    ({"temperature": True}, ["True", "number"]), ({"temperature": None}, ["None", "0 = greedy"]),
    ({"top_k": -1}, ["top_k", "-1", ">= 0"]), ({"top_k": 1.5}, ["top_k", "1.5"]), ({"top_k": True}, ["top_k", "True"]),
    ({"top_p": 0}, ["top_p", "0.0", "(0, 1]"]), ({"top_p": 1.5}, ["top_p", "1.5", "0.0..1.0"]),
    ({"top_p": math.nan}, ["top_p", "nan"]), ({"top_p": "x"}, ["top_p", "'x'"]),
    ({"seed": -1}, ["seed", "-1", ">= 0"]), ({"seed": 1.5}, ["seed", "1.5"]), ({"seed": "s"}, ["seed", "'s'"]),
    ({"seed": True}, ["seed", "True"]),
    ({"prompt": ""}, ["empty", "at least one"]), ({"prompt": []}, ["empty", "at least one"]),
    ({"prompt": [-1]}, ["-1", V]), ({"prompt": [4096]}, ["4096", V]), ({"prompt": [1.5]}, ["1.5", V]),
    ({"prompt": [True]}, ["True", V]), ({"prompt": 3}, ["got int", "text or a sequence"]),
    ({"prompt": None}, ["NoneType", "text or a sequence"]), ({"prompt": {"a": 1}}, ["dict", "text or a sequence"]),
    ({"prompt": np.zeros((2, 2), np.int64)}, ["(2, 2)", "one-dimensional"]),
    ({"prompt": [1] * 1024}, ["1024 tokens", "at most 1023"]),
    ({"stop": [""]}, ["''", "1..256 characters"]), ({"stop": [1]}, ["got 1", "1..256 characters"]),
    ({"stop": ["x" * 300]}, ["xxxx", "1..256 characters"]), ({"stop": ["a"] * 17}, ["17 stop strings", "at most 16"]),
    ({"stop_token_ids": [4096]}, ["4096", V]), ({"stop_token_ids": [-1]}, ["-1", V]),
    ({"stop_token_ids": ["a"]}, ["'a'", V]), ({"stop_token_ids": list(range(300))}, ["300", "at most 256"]),
    ({"ignore_eos": "no"}, ["ignore_eos", "'no'", "True or False"]), ({"ignore_eos": 1}, ["ignore_eos", "1"]),
    ({"ignore_eos": None}, ["ignore_eos", "None"]),
]


@pytest.mark.parametrize("kwargs, words", REQUESTS, ids=[f"request-{i}" for i in range(len(REQUESTS))])
@pytest.mark.parametrize("how", ["generate", "stream"])
def test_bad_request(session, reference, kwargs, words, how):
    args = {"prompt": PROMPT, "max_new_tokens": 16, "ignore_eos": True, **kwargs}
    prompt = args.pop("prompt")
    with pytest.raises(GenerationError) as info:
        getattr(session, how)(prompt, **args)  # a stream checks everything before it runs
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert session.generate(PROMPT, max_new_tokens=16, ignore_eos=True).token_ids == reference


# -- 2. building sessions, speculators and configs ---------------------------------------------------------------
def _bound_twice(graph, session):
    Session(graph, session.speculator, CFG)


def _head_for_another_target(graph, tmp):
    other = model_dir(tmp, "other-target", lambda d: d["source"].update(weights_sha256="0" * 64))
    Session(other, MtpHead(HEAD, CFG), CFG)


def _toml(name):
    return lambda graph, tmp, files: load_config(files / name, env={})


BUILD = [
    ("session k", lambda g, t, f: Session(g, PromptLookup(), CFG, k=0), GenerationError, ["got 0", "1..32"]),
    ("adaptive_k", lambda g, t, f: Session(g, PromptLookup(), CFG, adaptive_k="yes"), GenerationError,
     ["adaptive_k", "'yes'", "True or False"]),
    ("k_max", lambda g, t, f: Session(g, PromptLookup(), CFG, k_max=99), GenerationError, ["k_max", "99", "1..32"]),
    ("not a speculator", lambda g, t, f: Session(g, object(), CFG), GenerationError, ["object", "Speculator"]),
    ("lookup n", lambda g, t, f: PromptLookup(min_n=3, max_n=1), GenerationError, ["min_n=3", "max_n=1", "<="]),
    ("lookup k", lambda g, t, f: PromptLookup(k=0), GenerationError, ["got 0", "1..32"]),
    ("speculator twice", lambda g, t, f: _bound_twice(g, f), GenerationError, ["another Session", "one speculator"]),
    ("head hash", lambda g, t, f: _head_for_another_target(g, t), GenerationError, ["weights hash", "train one"]),
    ("model as head", lambda g, t, f: MtpHead(TARGET, CFG), ModelFormatError, ["not an MTP head", "DraftModel"]),
    ("head as draft", lambda g, t, f: DraftModel(HEAD, CFG), ModelFormatError, ["draft head", "MtpHead"]),
    ("head as target", lambda g, t, f: Session(HEAD, None, CFG), ModelFormatError, ["draft head", "--speculator mtp"]),
    ("bare onnx", lambda g, t, f: Session(TARGET / "model.onnx", None, CFG), ModelFormatError,
     ["rlxrt.json", "rlxrt export"]),
    ("threads", lambda g, t, f: Config(intra_op_threads=10 ** 6), ConfigError, ["1000000", "0..256"]),
    ("inter threads", lambda g, t, f: Config(inter_op_threads=-1), ConfigError, ["-1", "0..256"]),
    ("threads bool", lambda g, t, f: Config(intra_op_threads=True), ConfigError, ["True", "0..256"]),
    ("threads numpy float", lambda g, t, f: Config(intra_op_threads=np.float32(2.5)), ConfigError, ["2.5", "0..256"]),
    ("provider", lambda g, t, f: Config(providers=["gpu"]), ConfigError, ["'gpu'", "known providers"]),
    ("strict", lambda g, t, f: Config(strict="maybe"), ConfigError, ["'maybe'", "true or false"]),
    ("cache flag", lambda g, t, f: Config(cache=1), ConfigError, ["cache", "got 1", "true or false"]),
    ("optimisation", lambda g, t, f: Config(graph_optimization="max"), ConfigError, ["'max'", "basic"]),
    ("toml latin1", lambda g, t, f: _toml("latin1.toml")(g, t, f), ConfigError, ["latin1.toml", "UTF-8"]),
    ("toml dir", lambda g, t, f: _toml("a-dir")(g, t, f), ConfigError, ["a-dir", "is a directory"]),
    ("toml missing", lambda g, t, f: _toml("nope.toml")(g, t, f), ConfigError, ["nope.toml", "does not exist"]),
    ("toml syntax", lambda g, t, f: _toml("broken.toml")(g, t, f), ConfigError, ["broken.toml", "not valid TOML"]),
    ("env typo", lambda g, t, f: load_config(env={"RLXRT_THREAD": "2"}), ConfigError,
     ["RLXRT_THREAD", "RLXRT_INTRA_OP_THREADS"]),
    ("export force", lambda g, t, f: rlxrt.export(f / "nope", t / "out", force="no"), ExportError,
     ["force", "'no'", "True or False"]),
    ("export atol", lambda g, t, f: rlxrt.export(f / "nope", t / "out", atol=-1), ExportError, ["atol", "-1", "positive"]),
    ("export dtype", lambda g, t, f: rlxrt.export(f / "nope", t / "out", dtype="fp64"), ExportError,
     ["'fp64'", "fp32"]),
    ("export source", lambda g, t, f: rlxrt.export(f / "nope", t / "out"), ExportError, ["nope", "does not exist"]),
]


@pytest.mark.parametrize("name, build, error, words", BUILD, ids=[b[0] for b in BUILD])
def test_bad_construction(graph, session, reference, files, tmp_path, name, build, error, words):
    with pytest.raises(error) as info:
        build(graph, tmp_path, session if name == "speculator twice" else files)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert session.generate(PROMPT, max_new_tokens=16, ignore_eos=True).token_ids == reference


# -- 3. model directories with a bad manifest: refused at load, naming the field --------------------------------
def _set(path: str, value):
    def edit(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
    return edit


MANIFESTS = [
    ("chat", _set("chat", "ChatML"), ["chat", "JSON object"]),
    ("chat", _set("chat", {"template": "../t.jinja"}), ["chat.template", "no path"]),
    ("chat", _set("chat", {"template": "t.jinja", "end_of_turn_ids": [5000]}), ["chat.end_of_turn_ids[0]", "5000"]),
    ("chat", _set("chat", {"template": "t.jinja", "roles": []}), ["chat", "roles"]),
    ("vocab_size", _set("vocab_size", "4096"), ["vocab_size", "'4096'"]),
    ("vocab_size", _set("vocab_size", 0), ["vocab_size", "got 0"]),
    ("vocab_size", _set("vocab_size", 4000), ["vocab_size is 4000", "4096"]),
    ("max_positions", _set("max_positions", -1), ["max_positions", "-1"]),
    ("graph", _set("graph", "../model.onnx"), ["graph", "'../model.onnx'", "inside the model directory"]),
    ("graph", _set("graph", "missing.onnx"), ["'missing.onnx'", "missing"]),
    ("dtype", _set("dtype", "float64"), ["dtype", "'float64'", "float32"]),
    ("inputs", _set("inputs.input_ids", KeyError), ["inputs.input_ids", "required"]),
    ("inputs", _set("inputs.input_ids", "ids"), ["inputs.input_ids", "'ids'", "does not have"]),
    ("outputs", _set("outputs.logits", KeyError), ["outputs.logits", "required"]),
    ("outputs", _set("outputs.hidden_states", "nope"), ["outputs.hidden_states", "'nope'"]),
    ("kv layers", _set("kv_cache.layers", 7), ["kv_cache.past_key (layer 6)", "past_key_values.6.key"]),
    ("kv layers", _set("kv_cache.layers", 5), ["kv_cache.layers is 5", "past_key_values.5"]),
    ("kv layers", _set("kv_cache.layers", "6"), ["kv_cache.layers", "'6'"]),
    ("kv heads", _set("kv_cache.kv_heads", 8), ["kv_cache.kv_heads is 8", "has 4"]),
    ("head dim", _set("kv_cache.head_dim", 16), ["kv_cache.head_dim is 16", "has 32"]),
    ("kv dtype", _set("kv_cache.dtype", "float16"), ["kv_cache.dtype is 'float16'", "tensor(float)"]),
    ("kv dtype", _set("kv_cache.dtype", "int3"), ["kv_cache.dtype", "'int3'"]),
    ("kv pattern", _set("kv_cache.past_key", "past_key_values.key"), ["kv_cache.past_key", "{i}"]),
    ("seq axis", _set("kv_cache.seq_axis", 1), ["seq_axis", "got 1"]),
    ("no cache", _set("kv_cache", None), ["neither a KV cache", "state"]),
    ("eos", _set("eos_token_ids", [5000]), ["eos_token_ids[0]", "5000", V]),
    ("eos", _set("eos_token_ids", "0"), ["eos_token_ids", "'0'", "list"]),
    ("bos", _set("bos_token_id", -3), ["bos_token_id", "-3"]),
    ("tokenizer", _set("tokenizer", "../tokenizer.json"), ["tokenizer", "inside the model directory"]),
    ("unknown", _set("colour", "blue"), ["'colour'", "known"]),
    ("schema", _set("schema", "rlxrt.manifest/9"), ["rlxrt.manifest/9", "re-export"]),
    ("architecture", _set("architecture", KeyError), ["'architecture'", "missing"]),
    ("source", _set("source", "here"), ["source", "'here'", "JSON object"]),
    ("source hash", _set("source.weights_sha256", 12), ["source.weights_sha256", "12", "string"]),
    ("kv typo", _set("kv_cache.kv_head", 4), ["'kv_cache.kv_head'", "known here"]),
    ("capacity", _set("kv_cache.capacity", 0), ["kv_cache.capacity", "got 0"]),
    ("graph kind", _set("graph_kind", "magic"), ["graph_kind", "'magic'", "portable, fused"]),
    ("fused without capacity", _set("kv_cache.capacity", KeyError), ["kv_cache.capacity", "fused"]),
    ("capacity vs positions", _set("kv_cache.capacity", 512), ["'max_positions' (1024)", "512"]),
    ("fused roles", _set("inputs.num_logits", KeyError), ["inputs.num_logits", "fused"]),
    ("draft vocab", _set("draft_vocab", {"size": 4096, "ids": "ids.json"}), ["draft_vocab.size", "4096"]),
    ("draft vocab", _set("draft_vocab", {"size": 100, "ids": "../ids.json"}), ["draft_vocab.ids", "inside"]),
    ("draft vocab", _set("draft_vocab", {"size": 100, "ids": "ids.json"}), ["draft_vocab.size is 100", "4096"]),
    ("draft vocab", _set("draft_vocab", {"size": 100, "ids": "ids.json", "colour": 1}), ["'draft_vocab.colour'"]),
]
RAW = [("not json", b"{", ["not valid JSON"]), ("latin1", "{\"a\": \"\xe9\"}".encode("latin-1"), ["not UTF-8"]),
       ("a list", b"[]", ["JSON object", "list"])]


@pytest.mark.parametrize("name, edit, words", MANIFESTS, ids=[f"{m[0]}-{i}" for i, m in enumerate(MANIFESTS)])
def test_bad_manifest_fails_at_load(tmp_path, name, edit, words):
    d = model_dir(tmp_path, "model", edit)
    with pytest.raises(ModelFormatError) as info:
        Session(d, None, CFG)
    text = str(info.value)
    for w in words:
        assert w in text, (w, text)
    assert "re-export" in text or "rlxrt export" in text


@pytest.mark.parametrize("name, raw, words", RAW, ids=[r[0] for r in RAW])
def test_unreadable_manifest_fails_at_load(tmp_path, name, raw, words):
    d = model_dir(tmp_path, "model", raw=raw)
    with pytest.raises(ModelFormatError) as info:
        compile(d, CFG)
    for w in words + ["rlxrt.json"]:
        assert w in str(info.value), (w, str(info.value))


# -- 4. every CLI command ------------------------------------------------------------------------------------------
T, D = str(TARGET), str(DRAFT)
GEN = ["generate", "--target", T, "--prompt", "x"]
USAGE, ERROR = 2, 1
CLI = [
    (GEN + ["--draft", D, "--head", str(HEAD)], USAGE, ["--draft and --head", "one speculator"]),
    (GEN + ["--speculator", "none", "-k", "2"], USAGE, ["-k needs a speculator", "--speculator prompt-lookup"]),
    (GEN + ["--speculator", "none", "--adaptive-k"], USAGE, ["--adaptive-k needs a speculator"]),
    (GEN + ["--speculator", "draft"], USAGE, ["--speculator draft needs --draft DIR"]),
    (GEN + ["--speculator", "prompt-lookup", "--draft", D], USAGE, ["--draft and --speculator prompt-lookup"]),
    (GEN + ["--speculator", "prompt-lookup", "--draft-providers", "cpu"], USAGE, ["--draft-providers", "no model"]),
    (GEN + ["--prompt-file", "{f}/latin1.txt"], USAGE, ["either --prompt or --prompt-file"]),
    (["generate", "--target", T], USAGE, ["no prompt", "--prompt TEXT"]),
    (["generate", "--target", T, "--prompt-file", "{f}/nope.txt"], ERROR, ["nope.txt", "does not exist"]),
    (["generate", "--target", T, "--prompt-file", "{f}/a-dir"], ERROR, ["a-dir", "is a directory"]),
    (["generate", "--target", T, "--prompt-file", "{f}/latin1.txt"], ERROR, ["latin1.txt", "UTF-8"]),
    (GEN + ["--threads", "1000000"], ERROR, ["intra_op_threads", "1000000", "0..256"]),
    (GEN + ["--max-new-tokens", "0"], ERROR, ["max_new_tokens", "got 0"]),
    (GEN + ["--temperature", "-1"], ERROR, ["temperature", "-1"]),
    (GEN + ["--temperature", "nan"], ERROR, ["temperature", "nan"]),
    (GEN + ["--top-p", "2"], ERROR, ["top_p", "2.0"]),
    (GEN + ["--top-k", "-3"], ERROR, ["top_k", "-3"]),
    (GEN + ["--providers", "gpu"], ERROR, ["'gpu'", "known providers"]),
    (GEN + ["--speculator", "prompt-lookup", "-k", "99"], ERROR, ["99", "1..32"]),
    (GEN + ["--config", "{f}/broken.toml"], ERROR, ["broken.toml", "TOML"]),
    (GEN + ["--config", "{f}/latin1.toml"], ERROR, ["latin1.toml", "UTF-8"]),
    (GEN + ["--stop", ""], ERROR, ["stop string", "''"]),
    (["generate", "--target", "{f}/no-such-model", "--prompt", "x"], ERROR, ["no-such-model", "does not exist"]),
    (["generate", "--target", "{f}/empty-model", "--prompt", "x"], ERROR, ["empty-model", "rlxrt export"]),
    (GEN + ["--max-new-tokens", "many"], USAGE, ["--max-new-tokens", "'many'"]),
    (["bench", "--temperatures", "a,b"], USAGE, ["--temperatures", "'a,b'"]),
    (["bench", "--ks", "0"], ERROR, ["--ks", "1..32"]),
    (["bench", "--ks", "2,99"], ERROR, ["--ks", "'2,99'"]),
    (["bench", "--prompts", "0"], ERROR, ["--prompts", ">= 1"]),
    (["bench", "--repeats", "0"], ERROR, ["--repeats", ">= 1"]),
    (["bench", "--max-new-tokens", "-1"], ERROR, ["--max-new-tokens", ">= 1"]),
    (["bench", "--head", str(HEAD), "--no-head"], USAGE, ["--head and --no-head"]),
    (["bench", "--hf-target", "{f}"], USAGE, ["--hf-target and --hf-draft"]),
    (["bench", "--draft", D], USAGE, ["--target (and --draft", "or neither"]),
    (["bench", "--prompt-file", "{f}/bad.json"], ERROR, ["bad.json", "not valid JSON"]),
    (["bench", "--prompt-file", "{f}/object.json"], ERROR, ["object.json", "JSON list"]),
    (["bench", "--prompt-file", "{f}/numbers.json"], ERROR, ["entry 0", "non-empty string"]),
    (["bench", "--prompt-file", "{f}/nope.json"], ERROR, ["nope.json", "does not exist"]),
    (["bench", "--threads", "-1"], ERROR, ["intra_op_threads", "-1", "0..256"]),
    (["bench", "--providers", "gpu"], ERROR, ["'gpu'", "known providers"]),
    (["demo", "--prompt-index", "-1"], ERROR, ["--prompt-index", ">= 0"]),
    (["demo", "--prompt-index", "99"], ERROR, ["--prompt-index 99", "out of range"]),
    (["demo", "--repeats", "0"], ERROR, ["--repeats", ">= 1"]),
    (["demo", "--max-new-tokens", "0"], ERROR, ["--max-new-tokens", ">= 1"]),
    (["demo", "--draft", D], USAGE, ["both --target and --draft"]),
    (["demo", "--prompt-file", "{f}/latin1.txt"], ERROR, ["latin1.txt", "UTF-8"]),
    (["demo", "--threads", "999"], ERROR, ["intra_op_threads", "999", "0..256"]),
    (["demo", "--speculator", "mtp", "--target", str(TARGET), "--draft", D], USAGE,
     ["fits only the shipped target", "rlxrt generate --target DIR --head DIR"]),
    (["export", "{f}/nope", "{f}/out", "--atol", "-1"], ERROR, ["--atol", "-1"]),
    (["export", "{f}/nope", "{f}/out"], ERROR, ["nope", "does not exist"]),
    (["export", "{f}/hf-file", "{f}/out2"], ERROR, ["hf-file", "is a file"]),
    (["export", "{f}/llama-config", "{f}/out3", "--graph", "portable", "--greedy-head"], ERROR,
     ["greedy head is part of the fused graph", "drop --greedy-head"]),
    (["inspect", "{f}/nope.onnx"], ERROR, ["nope.onnx", "does not exist"]),
    (["inspect", "{f}/not-onnx.onnx"], ERROR, ["not-onnx.onnx", "not a readable ONNX model"]),
    (["compile", "{f}/nope.onnx"], ERROR, ["nope.onnx", "does not exist"]),
    (["compile", T, "--threads", "1000000"], ERROR, ["1000000", "0..256"]),
    (["providers", "--providers", "gpu"], ERROR, ["'gpu'", "known providers"]),
]


@pytest.mark.parametrize("argv, code, words", CLI, ids=[" ".join(a[:1] + a[-2:]) for a, _, _ in CLI])
def test_cli_bad_input(files, capsys, argv, code, words):
    argv = [a.replace("{f}", str(files)) for a in argv]
    try:
        got = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        got = exc.code
    err = capsys.readouterr().err
    assert got == code, err
    assert "Traceback" not in err and "internal error" not in err
    for w in words:
        assert w.replace("{f}", str(files)) in err, (w, err)


def test_the_table_is_big_enough():
    assert len(REQUESTS) * 2 + len(BUILD) + len(MANIFESTS) + len(RAW) + len(CLI) >= 80


def test_numpy_scalars_work_wherever_numbers_do(session, reference):
    g = session.generate(PROMPT, max_new_tokens=np.int32(16), temperature=np.float32(0.0), top_k=np.int64(0),
                         top_p=np.float64(1.0), k=np.int16(3), ignore_eos=np.bool_(True),
                         stop_token_ids=[np.int64(4095)])
    assert g.token_ids == reference
    ids = session.codec.encode(PROMPT)
    assert session.generate(np.asarray(ids, np.int32), max_new_tokens=16, ignore_eos=True).token_ids == reference
    assert Config(intra_op_threads=np.int64(1)).intra_op_threads == 1


def test_an_internal_error_is_reported_as_one(monkeypatch, capsys):
    """A bug is not disguised as bad input: the CLI says so and shows the traceback (exit code 3)."""
    import rlxrt.app.commands as commands

    def boom(args):
        raise KeyError("a bug")
    monkeypatch.setattr(commands, "_prompt", boom)
    assert main(["generate", "--target", T, "--prompt", "x"]) == 3
    err = capsys.readouterr().err
    assert "internal error, please report" in err and "Traceback" in err and "KeyError" in err


def test_usage_errors_are_rlxrt_errors():
    assert issubclass(UsageError, RlxrtError) and issubclass(GenerationError, RlxrtError)


def test_a_graph_input_the_manifest_does_not_declare_is_refused(graph):
    """Nothing would feed it: refused at load, not found by ONNX Runtime mid-request."""
    from rlxrt.backends import TensorSpec
    from rlxrt.backends.contract import check_contract

    extra = [*graph.inputs, TensorSpec("position_ids", (1, "sequence"), "tensor(int64)")]
    with pytest.raises(ModelFormatError, match="'position_ids' the manifest does not declare"):
        check_contract(graph.manifest, extra, graph.outputs, "rlxrt.json")
    check_contract(graph.manifest, graph.inputs, graph.outputs, "rlxrt.json")  # the real one passes
