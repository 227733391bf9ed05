"""Starting a server: in this process with uvicorn, or as a Ray Serve application of N replicas."""
from __future__ import annotations

import sys

from .options import ServeOptions, make_server


def serve_uvicorn(opts: ServeOptions, host: str, port: int, log_level: str = "info",
                  graceful_seconds: float | None = None) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, let in-flight requests finish (at most
    ``graceful_seconds``, default the request timeout) and stop the workers."""
    import uvicorn

    from .app import build_app

    sock = bind(host, port)  # a busy port is an error before anything is built or said
    server = make_server(opts)
    spec = server.session.speculator_name
    port = sock.getsockname()[1]
    how = f"batch engine, {opts.workers} sequences a step" if server.engine == "batch" else \
        f"pool engine, {opts.workers} worker(s)"
    if server.drafts == "batch":
        how += ", drafts batched"
    print(f"rlxrt: serving {server.model!r} on http://{host}:{port}/v1 ({how}, speculator {spec}, providers "
          f"{', '.join(server.session.target.providers)})", file=sys.stderr, flush=True)
    config = uvicorn.Config(build_app(server), log_level=log_level, timeout_graceful_shutdown=graceful_seconds
                            if graceful_seconds is not None else opts.request_timeout)
    uvicorn.Server(config).run(sockets=[sock])


def bind(host: str, port: int):
    """A listening socket on host:port (port 0: a free one); RlxrtError naming them when it cannot be had."""
    import socket

    from rlxrt.errors import RlxrtError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RlxrtError(f"--host {host!r} is not an address of this machine ({exc.strerror}); pass e.g. 127.0.0.1 "
                         "or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise RlxrtError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port, or stop the "
                         "program that holds it") from None
    sock.set_inheritable(True)
    return sock


def serve_ray(opts: ServeOptions, host: str, port: int, replicas: int, address: str | None = None) -> None:
    """Run the same app on Ray Serve: ``replicas`` replicas, each owning ``opts.workers`` Sessions, behind Ray's
    HTTP proxy on host:port; blocks until interrupted."""
    import ray
    from ray import serve

    from .ray_app import deployment

    ray.init(address=address, include_dashboard=False, configure_logging=False,
             **({} if address else {"num_cpus": max(replicas, 1)}))
    _start_proxy(serve, host, port)
    serve.run(deployment(opts, replicas), name="rlxrt", route_prefix="/", blocking=False)
    running = _running(serve, replicas)
    ready = "serving" if running == replicas else f"serving with {running} of {replicas} replicas ready so far"
    print(f"rlxrt: {ready} {opts.name!r} on http://{host}:{port}/v1 with Ray Serve ({running} replica(s) running x "
          f"{opts.workers} worker(s))", file=sys.stderr, flush=True)
    try:
        import signal
        import threading

        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        while not done.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


READY_SECONDS = 120.0
"""How long ``serve --ray`` waits for every replica to run before it says it serves (with the count)."""


def _running(serve, replicas: int) -> int:
    """Replicas of the deployment that run, once all of them do or after ``READY_SECONDS``."""
    import time

    deadline = time.monotonic() + READY_SECONDS
    while True:
        states = serve.status().applications["rlxrt"].deployments["rlxrt"].replica_states
        running = states.get("RUNNING", 0)
        if running >= replicas or time.monotonic() > deadline:
            return running
        time.sleep(0.5)


PROXY_TRIES = 3


def _start_proxy(serve, host: str, port: int) -> None:
    """``serve.start`` with a few tries: on a busy machine Ray's HTTP proxy can miss its 5 s readiness check,
    and Ray then kills it; a failure after the last try is a typed error, not a traceback."""
    from ray.exceptions import RayActorError

    from rlxrt.errors import RlxrtError

    for attempt in range(1, PROXY_TRIES + 1):
        try:
            serve.start(http_options={"host": host, "port": port})
            return
        except RayActorError as exc:
            if attempt == PROXY_TRIES:
                raise RlxrtError(f"Ray Serve could not start its HTTP proxy on {host}:{port} in {PROXY_TRIES} tries "
                                 f"({type(exc).__name__}); check that the port is free and the machine is not "
                                 "overloaded, then start again") from None
            print(f"rlxrt: Ray Serve's HTTP proxy did not start (try {attempt} of {PROXY_TRIES}); trying again",
                  file=sys.stderr, flush=True)
