"""A real rlxrt server (uvicorn on 127.0.0.1 and a free port) in a background thread of the test process."""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

from rlxrt.config import Config

SIMPLE_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}# assistant:{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, opts, graceful: float = 5.0):
        import uvicorn

        from rlxrt.app.serve.app import build_app
        from rlxrt.app.serve.options import make_server

        self.server = make_server(opts)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(self.server), host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=graceful)
        self.uv = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **{"timeout": 60, **kw})

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)


def options(target, speculator="none", draft=None, workers=2, config=None, **kw):
    from rlxrt.app.serve.options import ServeOptions

    config = config or Config(providers=("cpu",), intra_op_threads=1, cache=False)
    return ServeOptions(target=str(target), speculator=speculator, draft=str(draft) if draft else None,
                        config=config, workers=workers, model_name="m", **kw)


def with_chat_template(target: Path, out: Path, template: str = SIMPLE_TEMPLATE) -> Path:
    """A copy of a model directory whose manifest has a chat template (the shipped pair has none)."""
    shutil.copytree(target, out)
    manifest = json.loads((out / "rlxrt.json").read_text())
    manifest["chat"] = {"template": "chat_template.jinja", "bos_token": None, "eos_token": None,
                        "end_of_turn_ids": list(manifest["eos_token_ids"])}
    (out / "chat_template.jinja").write_text(template)
    (out / "rlxrt.json").write_text(json.dumps(manifest))
    return out
