"""A regular (non-editable) install works from another directory: the shipped assets are found through
importlib.resources, `rlxrt demo` and `rlxrt bench` run, and what bench writes carries no absolute path."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install --target`` of this checkout (no deps: this venv has them), built as a wheel."""
    target = tmp_path_factory.mktemp("site")
    # built from a copy: setuptools' build/ folder would otherwise keep files deleted from the checkout
    src = tmp_path_factory.mktemp("src") / "rlxrt"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", ".ci-venv", ".ci-sdist", ".test-cache",
                                                              "build", "*.egg-info", "__pycache__", ".pytest_cache",
                                                              "bench-out", "*.so"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(src)]
    try:
        import setuptools

        if int(setuptools.__version__.split(".")[0]) >= 68:  # the build needs no download then
            cmd.insert(4, "--no-build-isolation")
    except ImportError:
        pass
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (target / "rlxrt" / "__editable__").exists()
    assert list((target / "rlxrt" / "backends").glob("_stream_matmul*")), "the MatMul kernel was not built"
    return target


def run(installed: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLXRT_")}
    env["PYTHONPATH"] = str(installed)
    env["RLXRT_CACHE_DIR"] = str(cwd / "cache")
    return subprocess.run([str(installed / "bin" / "rlxrt"), *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def test_the_installed_package_is_the_one_used(installed, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    out = subprocess.run([sys.executable, "-c", "import rlxrt.app.reference as r, rlxrt; print(rlxrt.__file__); "
                          "print(r.REFERENCE); print(r.reference_weights())"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    module, assets, weights = out.stdout.splitlines()
    assert module.startswith(str(installed)) and assets.startswith(str(installed))
    assert (Path(assets) / "target" / "model.onnx").is_file() and (Path(assets) / "mtp" / "rlxrt.json").is_file()
    assert weights == "None"  # the Hugging Face weights of the recipe are not part of the wheel
    assert not list((installed / "rlxrt").rglob("*.jsonl")), "a log is in the wheel"


def test_demo_runs_from_another_directory(installed, tmp_path):
    out = run(installed, tmp_path, "demo", "--max-new-tokens", "16", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    assert "output identical to plain greedy decoding: yes" in out.stdout


def test_bench_runs_from_another_directory(installed, tmp_path):
    out = run(installed, tmp_path, "bench", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "8", "--ks", "2",
              "--temperatures", "0", "--no-hf", "--quiet", "--out", "res", "--threads", "1")
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "res" / "bench.json").read_text()
    rows = json.loads(text)["temperatures"]["0.0"]
    assert {"plain", "draft k=2", "mtp k=2", "prompt lookup k=4"} <= set(rows)
    assert str(installed) not in text and str(tmp_path) not in text
