import json
import os
import subprocess
import sys

import pytest


def rlxrt(*args, env_extra=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLXRT_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "rlxrt", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_version():
    import rlxrt as pkg

    r = rlxrt("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"rlxrt {pkg.__version__}"


def test_help_does_not_import_torch_or_ort():
    code = ("import sys; from rlxrt.app.cli import build_parser; build_parser().format_help(); "
            "print('torch' in sys.modules, 'onnxruntime' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["False", "False"], r.stderr


def test_providers_json():
    r = rlxrt("providers", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    by_name = {p["name"]: p for p in data["providers"]}
    assert by_name["cpu"]["available"] is True
    assert data["would_use"] == ["cpu"]
    assert {"cuda", "tensorrt", "coreml", "directml", "openvino", "qnn", "webgpu"} <= set(by_name)
    for p in data["providers"]:
        assert p["available"] or p["reason"]


def test_providers_strict_unavailable_exits_1():
    r = rlxrt("providers", "--json", "--providers", "coreml", "--strict")
    assert r.returncode == 1
    assert "coreml" in json.loads(r.stdout)["error"]


def test_compile_json_miss_then_hit(mlp, tmp_path):
    env = {"RLXRT_CACHE_DIR": str(tmp_path / "c")}
    first = rlxrt("compile", str(mlp), "--json", env_extra=env)
    assert first.returncode == 0, first.stderr
    a = json.loads(first.stdout)
    b = json.loads(rlxrt("compile", str(mlp), "--json", env_extra=env).stdout)
    assert (a["cache"], b["cache"]) == ("miss", "hit")
    assert a["providers"][0] == "cpu" and a["inputs"][0]["name"] == "x" and a["load_seconds"] > 0
    assert a["huge_pages"].startswith(("on: ", "off: "))  # waited for: never "collapsing"


def test_inspect_json(mlp):
    r = rlxrt("inspect", str(mlp), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["opset"] == 17 and info["inputs"][0]["shape"] == ["batch", 16] and info["manifest"] is None
    r = rlxrt("inspect", str(mlp))
    assert r.returncode == 0 and "opset 17" in r.stdout


@pytest.mark.parametrize("args, code, words", [
    (["compile", "/no/such/model.onnx"], 1, ["does not exist", "/no/such/model.onnx"]),
    (["compile", "MLP", "--providers", "gpu"], 1, ["unknown provider 'gpu'"]),
    (["compile"], 2, ["model"]),
    (["frobnicate"], 2, ["invalid choice"]),
])
def test_errors_and_exit_codes(mlp, args, code, words):
    args = [str(mlp) if a == "MLP" else a for a in args]
    r = rlxrt(*args)
    assert r.returncode == code
    for w in words:
        assert w in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_environment_is_a_clean_error(mlp):
    r = rlxrt("compile", str(mlp), env_extra={"RLXRT_THREADS": "2"})
    assert r.returncode == 1 and "RLXRT_THREADS" in r.stderr and "Traceback" not in r.stderr
