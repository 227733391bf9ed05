"""The dependency direction of docs/design.md: core <- backends <- sessions; exporters see only the core; the
application layer (rlxrt.app) sits on top. Checked twice: each core module imported alone in a fresh
interpreter, and every import statement (lazy ones included) read from the source."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = sorted(p.stem for p in (ROOT / "rlxrt").glob("*.py") if p.stem not in ("__init__", "__main__"))
HEAVY = ["onnxruntime", "torch", "transformers", "optimum", "rlxrt.backends", "rlxrt.sessions", "rlxrt.exporters",
         "rlxrt.app"]


def test_the_core_is_what_design_says():
    assert {"config", "errors", "manifest", "sampling", "acceptance", "speculator", "stats", "textstream"} <= set(CORE)
    assert not {"cli", "bench", "demo", "api", "reference", "inspect", "chart"} & set(CORE)


@pytest.mark.parametrize("module", ["rlxrt"] + [f"rlxrt.{m}" for m in CORE])
def test_core_module_imports_alone(module):
    code = (f"import sys, json; import {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('onnxruntime', 'torch', "
            f"'transformers', 'optimum') or m.startswith(('rlxrt.backends', 'rlxrt.sessions', 'rlxrt.exporters', "
            f"'rlxrt.app')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [], f"{module} pulls in {out.stdout}"


def imports_of(path: Path, package: str) -> set[str]:
    """Absolute names of every module a file imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            else:
                found.add(node.module)
    return found


FORBIDDEN = {
    "rlxrt": ("onnxruntime", "torch", "transformers", "optimum", "rlxrt.backends", "rlxrt.sessions",
              "rlxrt.exporters", "rlxrt.app"),
    "exporters": ("rlxrt.backends", "rlxrt.sessions", "rlxrt.app"),  # ORT's offline graph tools are fine
    "backends": ("torch", "transformers", "optimum", "rlxrt.sessions", "rlxrt.exporters", "rlxrt.app"),
    "sessions": ("torch", "transformers", "optimum", "rlxrt.exporters", "rlxrt.app"),
}
PACKAGE = {"rlxrt": "rlxrt", "exporters": "rlxrt.exporters", "backends": "rlxrt.backends",
           "sessions": "rlxrt.sessions"}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_import_runs_against_the_direction(folder):
    files = [p for p in ((ROOT / folder).glob("*.py") if folder == "rlxrt" else (ROOT / folder).rglob("*.py"))
             if p.name != "__main__.py"]  # `python -m rlxrt` is the CLI's entry, not core
    bad = []
    for path in files:
        package = PACKAGE[folder] + "".join(f".{p}" for p in path.relative_to(ROOT / folder).parent.parts)
        for name in imports_of(path, package):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_only_backends_create_ort_sessions():
    makers = [str(p.relative_to(ROOT)) for folder in ("rlxrt", "exporters", "sessions") for p in (ROOT / folder).rglob("*.py")
              if "InferenceSession(" in p.read_text(encoding="utf-8")]
    assert makers == []
