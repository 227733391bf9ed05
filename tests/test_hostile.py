"""Hostile input, table-driven: model directories that reach outside themselves (escaping external-data
locations, symbolic links, FIFOs, devices, huge or deeply nested files), a GGUF whose metadata lies, deep JSON
in a corpus, and chat templates that loop, exponentiate or multiply strings.

Each case runs in a fresh process under a memory limit (address space ``MEMORY``) and must end, within
``SECONDS``, with the typed error its row names (and words of its message); the parent measures its wall time
and peak memory. ``python tests/test_hostile.py`` prints the table of every case with those two figures.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from rlxrt.app.reference import reference_pair  # noqa: E402

TARGET, _ = reference_pair()
MEMORY = 3 << 30
"""Address space of a case's process (bytes); the ORT session of the shipped target peaks near 0.4 GiB."""
SECONDS = 20.0
"""Wall time a case may take, its process's start and imports included (a few seconds in practice)."""

CHILD = r"""
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]),) * 2)
case = json.loads(sys.argv[1])
try:
    import rlxrt
    from rlxrt.sessions import Session
    cfg = rlxrt.Config(cache=False, intra_op_threads=1, cpu_kernels=case.get("kernels", "auto"))
    what, arg = case["action"], case["arg"]
    if what == "session":
        Session(arg, None, cfg).generate("x", max_new_tokens=2)
    elif what == "chat":
        Session(arg, None, cfg).chat([{"role": "user", "content": "hi"}], max_new_tokens=2)
    elif what == "export":
        rlxrt.export(arg, case["out"])
    elif what == "corpus":
        from rlxrt.app.train_head import documents
        documents([arg])
    report = {"error": None}
except BaseException as exc:
    report = {"error": type(exc).__name__, "typed": isinstance(exc, rlxrt.RlxrtError), "message": str(exc)[:2000]}
peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(json.dumps({**report, "peak_mib": round(peak / 1024)}))
"""


def _copy_target(root: Path, name: str) -> Path:
    d = root / name
    shutil.copytree(TARGET, d)
    return d


def _manifest(d: Path, **fields) -> None:
    data = json.loads((d / "rlxrt.json").read_text())
    data.update(fields)
    (d / "rlxrt.json").write_text(json.dumps(data))


def _external(d: Path, location: str | None = None, offset: int | None = None) -> None:
    """Rewrite the graph's first external tensor to read ``location`` / from ``offset``."""
    import onnx

    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location" and location is not None:
            entry.value = location
        if entry.key == "offset" and offset is not None:
            entry.value = str(offset)
    onnx.save(model, str(d / "model.onnx"))


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _swap_link(path: Path, target: Path | str) -> None:
    path.unlink()
    os.symlink(target, path)


def _with_template(d: Path, template: str) -> None:
    (d / "chat_template.jinja").write_text(template)
    _manifest(d, chat={"template": "chat_template.jinja", "bos_token": None, "eos_token": None,
                       "end_of_turn_ids": [0]})


def _lying_gguf(root: Path) -> Path:
    """A small GGUF whose metadata claims 64 blocks of width 8192; it holds two blocks of width 64."""
    import gguf
    import numpy as np

    path = root / "lying.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("add_block_count", 64), ("add_embedding_length", 8192), ("add_feed_forward_length", 28672),
                       ("add_head_count", 64), ("add_head_count_kv", 8), ("add_context_length", 4096)):
        getattr(w, key)(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(100)])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((100, 64)).astype(np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _deep(path: Path, depth: int = 200_000) -> Path:
    path.write_text("[" * depth + "]" * depth)
    return path


def _outside(root: Path) -> Path:
    """Files outside every model directory of the cases: a copy of the target's weights and tokenizer, and
    random bytes."""
    outside = root / "outside"
    if not outside.exists():
        outside.mkdir()
        shutil.copy(TARGET / "model.onnx.data", outside / "model.onnx.data")
        shutil.copy(TARGET / "tokenizer.json", outside / "tokenizer.json")
        (outside / "secret").write_bytes(os.urandom(1 << 16))
    return outside


def _model(edit):
    """A case's subject: a copy of the shipped target edited by ``edit(directory, outside)``."""
    def make(root: Path, name: str) -> str:
        d = _copy_target(root, name.replace("/", "_").replace(" ", "_"))
        edit(d, _outside(root))
        return str(d)
    return make


TEMPLATES = [
    ("template loops 10^10 times", "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
                                   "{% endfor %}", ["time budget"]),
    ("template 9 ** (9 ** 9)", "{{ 9 ** (9 ** 9) }}", ["went past a limit", "bits"]),
    ("template content * 10**9", "{{ messages[0]['content'] * 10 ** 9 }}", ["went past a limit"]),
    ("template '%0999999999d' % 1", "{{ '%0999999999d' % 1 }}", ["went past a limit"]),
    ("template 'x'.center(10**9)", "{{ 'x'.center(10 ** 9) }}", ["went past a limit"]),
    ("template doubles a text 64 times", "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                                         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", ["MemoryError"]),
    ("template recurses", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ["went past a limit"]),
]


def _table() -> list[dict]:
    """Each case: its name, the action its process runs, how to make its subject (``make(root, name)``), the
    error class and words its message must hold, and the kernel set."""
    rows = []

    def model(name, edit, words, error="ModelFormatError", action="session", kernels="auto"):
        rows.append({"name": name, "action": action, "make": _model(edit), "error": error, "words": words,
                     "kernels": kernels})

    for kernels in ("rlxrt", "ort"):
        model(f"data at ../secret ({kernels} kernels)", lambda d, o: _external(d, "../outside/secret"),
              ["external data", "not a relative path inside"], kernels=kernels)
        model(f"data at /etc/passwd ({kernels} kernels)", lambda d, o: _external(d, "/etc/passwd"),
              ["external data", "not a relative path inside"], kernels=kernels)
        model(f"data offset past the file ({kernels} kernels)", lambda d, o: _external(d, offset=1 << 40),
              ["truncated"], kernels=kernels)
    model("data file a symlink out", lambda d, o: _swap_link(d / "model.onnx.data", o / "model.onnx.data"),
          ["outside the directory"])
    model("graph a FIFO", lambda d, o: _fifo(d / "model.onnx"), ["graph", "not a regular file"])
    model("tokenizer a symlink out", lambda d, o: _swap_link(d / "tokenizer.json", o / "tokenizer.json"),
          ["tokenizer", "outside the directory"])
    model("tokenizer a FIFO", lambda d, o: _fifo(d / "tokenizer.json"), ["tokenizer", "not a regular file"])
    model("tokenizer -> /dev/zero", lambda d, o: _swap_link(d / "tokenizer.json", "/dev/zero"),
          ["tokenizer", "outside the directory"])
    model("tokenizer of 300 MB", lambda d, o: os.truncate(d / "tokenizer.json", 300 << 20),
          ["tokenizer", "more than the"])
    model("manifest a FIFO", lambda d, o: _fifo(d / "rlxrt.json"), ["manifest", "not a regular file"])
    model("manifest -> /dev/zero", lambda d, o: _swap_link(d / "rlxrt.json", "/dev/zero"), ["manifest", "outside"])
    model("manifest of 5 MB", lambda d, o: (d / "rlxrt.json").write_text(" " * (5 << 20)), ["manifest", "more than"])
    model("manifest nested 200k deep", lambda d, o: _deep(d / "rlxrt.json"), ["manifest", "too deeply"])
    model("template a FIFO", lambda d, o: (_with_template(d, "x"), _fifo(d / "chat_template.jinja")),
          ["chat template", "not a regular file"], action="chat")
    model("template a symlink out", lambda d, o: (_with_template(d, "x"),
                                                  _swap_link(d / "chat_template.jinja", o / "secret")),
          ["chat template", "outside the directory"], action="chat")
    for name, source, words in TEMPLATES:
        model(name, lambda d, o, s=source: _with_template(d, s), words, error="GenerationError", action="chat")
    rows.append({"name": "GGUF claiming 64 blocks of 8192", "action": "export", "error": "ExportError",
                 "make": lambda root, name: str(_lying_gguf(root)), "words": ["block_count", "64"]})
    rows.append({"name": "corpus nested 200k deep", "action": "corpus", "error": "InputError",
                 "make": lambda root, name: str(_deep(root / "deep.json")), "words": ["too deeply"]})
    return rows


TABLE = _table()


def run_case(case: dict, root: Path) -> tuple[dict, float]:
    """(the report of the process that ran the case, its wall seconds); the report holds the peak resident MiB
    of that process and of the processes it waited for (a template's renderer)."""
    job = {"action": case["action"], "arg": case["make"](root, case["name"]), "kernels": case.get("kernels", "auto"),
           "out": str(root / "export-out")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job), str(MEMORY)], capture_output=True, text=True,
                          timeout=SECONDS * 3)
    seconds = time.monotonic() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    report = json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}", "message": proc.stderr[-1500:]}
    return report, seconds


@pytest.mark.slow
@pytest.mark.parametrize("case", TABLE, ids=[c["name"] for c in TABLE])
def test_hostile_input_ends_in_a_typed_error_quickly(case, tmp_path):
    if case["action"] == "export":
        pytest.importorskip("gguf")
    report, seconds = run_case(case, tmp_path)
    assert report["error"] == case["error"] and report.get("typed"), report
    for word in case["words"]:
        assert word in report["message"], (word, report["message"])
    assert seconds < SECONDS, seconds


if __name__ == "__main__":  # the table for the record: python tests/test_hostile.py
    import tempfile

    print("| case | typed error | seconds | peak MiB |\n| --- | --- | --- | --- |")
    for c in TABLE:
        with tempfile.TemporaryDirectory() as d:
            r, s = run_case(c, Path(d))
        print(f"| {c['name']} | {r['error']}: {r.get('message', '')[:100]} | {s:.2f} | {r.get('peak_mib', '?')} |",
              flush=True)
