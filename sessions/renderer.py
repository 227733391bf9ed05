"""Chat templates rendered in processes of their own (``template_worker.py``), each render under a deadline
and every process under a memory limit: a template that loops or builds a huge text costs one process, which
is killed at the deadline, never the caller's time beyond it or the serving process's GIL.

A ``Renderer`` keeps the processes of one template: idle ones are reused (a render costs a pipe round trip,
~0.1 ms), a busy pool starts another, up to ``MAX_PROCESSES`` at once (more renders wait for one, within
their own deadline). A process that misses its deadline or dies is replaced by a fresh one on the next
render.
"""
from __future__ import annotations

import importlib.resources
import json
import queue
import subprocess
import sys
import threading
import time
import weakref

from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.limits import TEMPLATE_MEMORY_BYTES

MAX_PROCESSES = 8
"""Renders running at once for one template."""
IDLE = 2
"""Idle processes kept for the next renders."""


class _Expired(Exception):
    pass


class _Process:
    """One worker process and the thread that reads its replies."""

    def __init__(self, source: str):
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", source, str(TEMPLATE_MEMORY_BYTES)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="rlxrt-template-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def ask(self, request: bytes, seconds: float) -> dict:
        """The reply to ``request`` (one JSON line); _Expired after ``seconds``."""
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
        except OSError:
            return {"error": "the template's renderer process exited", "kind": "died"}
        try:
            line = self.replies.get(timeout=max(seconds, 0.0))
        except queue.Empty:
            raise _Expired from None
        if line is None:
            return {"error": "the template's renderer process ran out of memory or died", "kind": "died"}
        return json.loads(line)

    def close(self) -> None:
        """Stop the process and reap it (no zombie left behind)."""
        try:
            self.proc.kill()
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


class Renderer:
    """Renders one template source in worker processes; thread-safe."""

    def __init__(self, template: str, special: dict[str, str], where: str, seconds: float):
        self._load = _line({"template": template, "special": special})
        self._where, self._seconds = where, seconds
        self._source = importlib.resources.files("rlxrt.sessions").joinpath("template_worker.py").read_text()
        self._idle: list[_Process] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_PROCESSES)
        weakref.finalize(self, _close_all, self._idle)
        self._give(self._start(time.monotonic() + seconds, loading=True))  # it parses, or the model is refused

    def _start(self, deadline: float, loading: bool = False) -> _Process:
        try:
            process = _Process(self._source)
        except OSError as exc:
            raise GenerationError(f"cannot start a process to render the chat template ({exc}); check that "
                                  f"{sys.executable!r} runs") from None
        reply = self._ask(process, self._load, deadline, loading)
        if "ok" not in reply:
            process.close()
            verb = "parse" if reply.get("kind") == "syntax" else "load"
            raise (ModelFormatError if loading else GenerationError)(
                f"the chat template {self._where!r} does not {verb}: {reply['error']}; re-export the model or fix "
                "the template")
        return process

    def _give(self, process: _Process) -> None:
        with self._lock:
            if len(self._idle) < IDLE:
                self._idle.append(process)
                return
        process.close()

    def _ask(self, process: _Process, request: bytes, deadline: float, loading: bool = False) -> dict:
        try:
            return process.ask(request, deadline - time.monotonic())
        except _Expired:
            process.close()
            what = "load" if loading else "render these messages"
            error = ModelFormatError if loading else GenerationError
            raise error(f"the model's chat template did not {what} within its time budget (it loops, or builds a "
                        f"huge text); it was stopped. Fix the template ({self._where!r}) or send a plain prompt") \
                from None

    def render(self, messages: list[dict], add_generation_prompt: bool, max_chars: int,
               seconds: float | None = None) -> str:
        """The text of ``messages`` (checked already); GenerationError when the template refuses them, runs
        past ``seconds`` (default: the renderer's budget) or past its limits."""
        deadline = time.monotonic() + (self._seconds if seconds is None else min(seconds, self._seconds))
        try:
            request = _line({"messages": messages, "add_generation_prompt": add_generation_prompt,
                             "max_chars": max_chars})
        except (TypeError, ValueError) as exc:
            raise GenerationError(f"the messages hold a value that is not JSON ({exc}); send text") from None
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise GenerationError(f"the chat template's {MAX_PROCESSES} renderer processes stayed busy for the whole "
                                  "time budget; retry later")
        try:
            with self._lock:
                process = self._idle.pop() if self._idle else None
            if process is not None and process.proc.poll() is not None:  # it died while idle
                process.close()
                process = None
            if process is None:
                process = self._start(deadline)
            reply = self._ask(process, request, deadline)
        finally:
            self._slots.release()
        if "text" in reply:
            self._give(process)
            return reply["text"]
        if reply.get("kind") == "died":
            process.close()
            raise GenerationError("rendering the chat template took more memory than a template may use "
                                  f"({TEMPLATE_MEMORY_BYTES >> 20} MiB), and was stopped; fix the template")
        self._give(process)
        if reply.get("kind") == "limit":
            raise GenerationError(f"the model's chat template went past a limit rendering these messages "
                                  f"({reply['error']}); it was stopped")
        raise GenerationError(f"the model's chat template refused these messages: {reply['error']}")

    def close(self) -> None:
        _close_all(self._idle)


def _line(request: dict) -> bytes:
    return json.dumps(request).encode("ascii") + b"\n"


def _close_all(processes: list[_Process]) -> None:
    while processes:
        processes.pop().close()
