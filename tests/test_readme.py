"""The set-up promise: CI runs the README's two quickstart commands verbatim, and the README's examples
use modules that exist."""
import re
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)
            for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_quickstart_verbatim():
    commands = quickstart_commands()
    assert len(commands) == 2 and "rlxrt demo" in commands[0] and "pytest" in commands[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci, f"{command!r} is not run by .ci/run"


def test_python_modules_named_in_the_readme_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in sorted(set(re.findall(r"python -m (rlxrt[\w.]*)", text)) |
                       set(re.findall(r"from (rlxrt[\w.]*) import", text))):
        import_module(name)
