"""``rlxrt serve``: an OpenAI-compatible HTTP server over a pool of Sessions (FastAPI + uvicorn), its Ray Serve
deployment and its load benchmark. Needs ``pip install 'rlxrt[serve]'`` (``rlxrt[ray]`` for Ray Serve)."""
