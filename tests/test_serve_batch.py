"""The server on the batch engine (``--engine batch``): every request in flight is decoded in one batched step,
and none of them can tell: 64 concurrent mixed requests (greedy and seeded sampled, streamed or not, of
different lengths) each equal the same request sent alone, and greedy ones equal plain greedy decoding."""
from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serving import Running, options  # noqa: E402

from rlxrt.app.flags import head_dir  # noqa: E402
from rlxrt.app.reference import reference_pair, reference_prompts  # noqa: E402
from rlxrt.config import Config  # noqa: E402
from rlxrt.sessions import Session  # noqa: E402

TARGET, DRAFT = reference_pair()
HEAD = head_dir(None, None)
PROMPTS = reference_prompts()


def _ask(client, prompt: str, n: int, temperature: float, seed: int | None, stream: bool) -> str:
    kw = dict(model="m", prompt=prompt, max_tokens=n, temperature=temperature, extra_body={"ignore_eos": True},
              **({"seed": seed} if seed is not None else {}))
    if stream:
        return "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw))
    return client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("speculator, draft", [("lookup+draft", DRAFT), ("lookup+mtp", HEAD), ("none", None)])
def test_64_concurrent_mixed_requests_equal_each_alone(speculator, draft):
    server = Running(options(TARGET, speculator, draft, workers=8, engine="batch",
                             adaptive_k=speculator != "none"))
    try:
        assert server.server.engine == "batch"
        import json
        import urllib.request

        with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
            health = json.loads(r.read())
        assert health["engine"] == "batch" and health["drafts"] == ("batch" if draft else None)
        c = server.client()
        requests = [(PROMPTS[i % len(PROMPTS)], 8 + 5 * (i % 9), 0.0 if i % 3 else 0.9, None if i % 3 else 500 + i,
                     bool(i % 2)) for i in range(64)]
        alone = [_ask(c, *r) for r in requests]
        out: list = [None] * 64

        def one(i):
            out[i] = _ask(server.client(), *requests[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert out == alone
        with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
            report = json.loads(r.read())["batch"]
        assert report["slots"] == 8 and report["steps"] > 0 and 1.0 <= report["sequences_per_step"] <= 8
        assert set(report["guards"].values()) <= {"drafting", "plain"} and all(v >= 0 for v in report["gap_ms"].values())
        assert set(report["gap_ms"]) <= {"1", "2", "3-4", "5-8"}  # per load, in sequences a step (8 slots)
        if speculator != "none":  # lookup and the model each priced apart, once they drafted before a step
            model = "draft-model" if speculator == "lookup+draft" else "mtp-head"
            assert {n for costs in report["draft_token_ms"].values() for n in costs} <= {"prompt-lookup", model}
            assert report["guards"]
            assert set(report["acceptance"]) == set(report["answers"]) and report["acceptance"]
            assert all(len(a) == 4 and all(0 <= x <= 1 for x in a) for a in report["acceptance"].values())
        else:  # nothing drafts: no guard has anything to decide
            assert report["guards"] == {} and report["draft_token_ms"] == {} and report["acceptance"] == {}
        plain = Session(TARGET, None, Config(intra_op_threads=1, cache=False, cpu_kernels="ort"))
        for (prompt, n, temperature, _, _), text in list(zip(requests, alone))[1:12:3]:  # greedy ones
            assert temperature == 0.0
            assert text == plain.generate(prompt, max_new_tokens=n, ignore_eos=True).text
    finally:
        server.stop()


def test_auto_engine_falls_back_to_the_pool_where_the_target_cannot_batch():
    server = Running(options(TARGET, config=Config(providers=("cpu",), intra_op_threads=1, cache=False,
                                                   cpu_kernels="ort")))
    try:
        assert server.server.engine == "pool"
        assert "cpu_kernels = rlxrt" in server.server.engine_reason  # the reason, with the fix, also logged
        assert server.client().completions.create(model="m", prompt="x", max_tokens=3).usage.completion_tokens == 3
    finally:
        server.stop()
