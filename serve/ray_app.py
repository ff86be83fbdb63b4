"""specdec on Ray Serve: the same OpenAI routes on many replicas, behind Ray Serve's HTTP proxy.

Each replica is one ``SpecdecReplica`` actor: it checks the bundle (manifest, paths and every
graph's sha256, as ``specdec serve`` does), loads and warms a ``BatchEngine``, and runs the
app of ``specdec.serve.app`` over it (the same request handling, not a second implementation)
on each request a ``SpecdecFront`` relays to it (``specdec.serve.relay``: the application's
ingress, on the head node; a replica that dies before answering is retried on another, and
every failure is an OpenAI error body, never Ray's plain text). Ray Serve routes requests to
replicas, bounds their queues (``max_ongoing_requests``, ``max_queued_requests``; see SLACK
below), calls ``check_health`` (a replica whose engine thread died reports unhealthy and is
replaced) and restarts dead replicas.

    specdec serve BUNDLE --ray --replicas 2              # a local Ray instance on this machine
    specdec serve BUNDLE --ray --ray-address auto        # onto a running cluster
    serve run docs/ray/serve_config.yaml                 # or a config, without the specdec CLI

``app_builder`` is the application builder such a config names (``import_path``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import ray
from ray import serve

from specdec.errors import ConfigError
from specdec.manifest import load_manifest
from specdec.serve.app import build_app
from specdec.serve.relay import Front, run_app
from specdec.serve.server import ServeConfig, is_loopback, load_engine, local_bundle, prepare
from specdec.store import is_uri

# Back-pressure is the engine's, as in `specdec serve`: a replica takes every request its engine
# can hold (rows + queue) plus SLACK that are being answered 503 at once, so a full engine answers
# with the OpenAI error body and Retry-After. The deployment's own queue (MAX_QUEUED) is only a
# safety net: past it the front answers 503 (queue_full) itself.
SLACK = 8
MAX_QUEUED = 64
FRONT_ONGOING = 4096  # requests the front relays at once: it only waits on replicas
# Ray's head-node resource: the front lives on the head node, beside the controller, so a lost worker node never takes it
ON_HEAD = {"node:__internal_head__": 0.001}


class SpecdecReplica:
    """One replica: the bundle loaded once, a batched engine, the OpenAI routes."""

    def __init__(self, config: dict):
        cfg = local_bundle(ServeConfig(**config))  # a stored bundle: fetched once per node (a lock shares it)
        self.state = prepare(cfg, bind=False)  # the bundle's hashes are checked here, on this replica's machine
        self.state.engine = load_engine(cfg, self.state)  # loaded and warmed before the replica is ready
        replica = serve.get_replica_context().replica_id.unique_id
        self.state.fingerprint = f"specdec-replica-{replica}"
        self.state.metrics.replica(replica)
        self.app = build_app(self.state)

    async def http(self, request: dict):
        """One HTTP request relayed by the front: the app's ASGI messages, as it sends them."""
        async for message in run_app(self.app, request):
            yield message

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        if not self.state.engine.alive:
            raise RuntimeError("the batch engine's thread has stopped")

    def __del__(self):
        engine = getattr(getattr(self, "state", None), "engine", None)
        if engine is not None:
            engine.close()


@serve.ingress()
class SpecdecFront:
    """The application's ingress: relays each HTTP request to a replica (``specdec.serve.relay``)."""

    def __init__(self, model):
        self.front = Front(model)

    def __serve_build_asgi_app__(self):
        return self.front


def parse_autoscale(text: str) -> tuple[int, int]:
    """``--autoscale MIN:MAX`` as two replica counts."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--autoscale {text!r}: expected MIN:MAX replica counts such as 1:4") from None
    if not 0 <= lo <= hi or hi < 1:
        raise ConfigError(f"--autoscale {text!r}: expected 0 <= MIN <= MAX and MAX >= 1")
    return lo, hi


AUTOSCALE_DELAYS = ("upscale_delay_s", "downscale_delay_s")  # Ray Serve's autoscaling_config fields a config may set


def application(cfg: ServeConfig, replicas: int = 1, autoscale: tuple[int, int] | None = None, num_cpus: float = 1.0,
                max_ongoing: int | None = None, max_queued: int = MAX_QUEUED, delays: dict[str, float] | None = None):  # fmt: skip
    """The Ray Serve application: ``replicas`` copies (or autoscaling between ``autoscale``,
    with Ray Serve's ``delays``: ``upscale_delay_s``, ``downscale_delay_s``). ``max_ongoing``
    (requests per replica) defaults to what its engine holds + SLACK."""
    if replicas < 1:
        raise ConfigError(f"--replicas {replicas}: expected >= 1")
    rows = cfg.max_batch or load_manifest(local_bundle(cfg).bundle, verify_hashes=False).max_batch
    if max_ongoing is None:
        max_ongoing = rows + cfg.max_queue + SLACK
    scale: dict[str, Any] = {"num_replicas": replicas}
    if autoscale:
        # scale up once requests queue for rows
        scale = {"autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1], "target_ongoing_requests": rows, **(delays or {})}}
    config = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    # replicas do not share the driver's working directory; a URI is fetched by each replica's node
    config["bundle"] = str(cfg.bundle) if is_uri(cfg.bundle) else Path(cfg.bundle).resolve()
    deployment = serve.deployment(SpecdecReplica, name="specdec", max_ongoing_requests=max_ongoing, max_queued_requests=max_queued,
                                  ray_actor_options={"num_cpus": num_cpus}, health_check_period_s=5, **scale)  # fmt: skip
    front = serve.deployment(SpecdecFront, name="specdec-front", num_replicas=1, max_ongoing_requests=FRONT_ONGOING,
                             ray_actor_options={"num_cpus": 0, "resources": ON_HEAD})  # fmt: skip
    return front.bind(deployment.bind(config))


def app_builder(args: dict[str, Any]):
    """For ``serve run`` / ``serve deploy`` configs: ``args`` holds ``bundle`` and any other
    ``ServeConfig`` field, plus ``replicas``, ``autoscale`` ("MIN:MAX") with Ray Serve's
    ``upscale_delay_s`` / ``downscale_delay_s``, ``num_cpus``, ``max_ongoing_requests`` and
    ``max_queued_requests``."""
    args = dict(args)
    if "bundle" not in args:
        raise ConfigError("the application's args need a bundle: args: {bundle: /path/to/bundle}")
    kw = dict(replicas=int(args.pop("replicas", 1)), num_cpus=float(args.pop("num_cpus", 1.0)),
              max_queued=int(args.pop("max_queued_requests", MAX_QUEUED)))  # fmt: skip
    if "max_ongoing_requests" in args:
        kw["max_ongoing"] = int(args.pop("max_ongoing_requests"))
    if "autoscale" in args:
        kw["autoscale"] = parse_autoscale(str(args.pop("autoscale")))
        kw["delays"] = {k: float(args.pop(k)) for k in AUTOSCALE_DELAYS if k in args}
    elif any(k in args for k in AUTOSCALE_DELAYS):
        raise ConfigError(f"application args {[k for k in AUTOSCALE_DELAYS if k in args]}: need autoscale: \"MIN:MAX\"")
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"application args {unknown}: unknown; expected bundle and the specdec serve options ({', '.join(sorted(known))})")
    args["bundle"] = args["bundle"] if is_uri(args["bundle"]) else Path(args["bundle"])
    return application(ServeConfig(**args), **kw)


def run(cfg: ServeConfig, replicas: int = 1, autoscale: tuple[int, int] | None = None, address: str | None = None,
        num_cpus: float = 1.0, proxy_location: str = "EveryNode") -> int:  # fmt: skip
    """``specdec serve --ray``. Without ``address``: start a local Ray instance, serve until
    SIGTERM/SIGINT, then shut Serve and Ray down and return 0. With one: deploy onto that
    cluster and return (the application keeps running there; ``serve shutdown`` removes it).

    Our handler is installed before anything starts, and Ray is started on a thread of its own
    (``Startup``): ``ray.init`` sets its own SIGTERM handler (``sys.exit(15)``, no drain) when it
    runs on the main thread, and ``serve.run`` blocks until every replica is up. So a SIGTERM at
    any moment, during start-up, during the roll-out or under load, ends in the same bounded
    shutdown, with exit status 0."""
    import signal
    import sys

    wake = threading.Event()  # a signal, or the start-up ended
    stopping = threading.Event()

    def on_signal(*_) -> None:
        stopping.set()
        wake.set()

    def install() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    install()
    local = local_bundle(cfg)  # a stored bundle: fetched (and verified) on this node too
    prepare(local)  # refuse a bad bundle or option before starting anything (one line, exit 2)
    app = application(cfg, replicas, autoscale, num_cpus)
    if stopping.is_set():  # a signal while the bundle was fetched or checked: nothing started yet
        return 0
    print(f"specdec: {f'connecting to Ray at {address}' if address else 'starting a local Ray instance'} "
          "(SIGTERM or Ctrl-C from here on shuts down gracefully)", file=sys.stderr, flush=True)  # fmt: skip
    startup = Startup(cfg, app, address, stopping, wake, proxy_location)
    try:
        while not (startup.ray_up.wait(0.2) or stopping.is_set()):
            pass
        install()  # ray.init's core worker put its own C handler (absl's) in front of ours
        wake.wait()
        if not stopping.is_set():
            if startup.error is not None:
                raise startup.error
            print(f"specdec: {local.served_model_name or Path(cfg.bundle).resolve().name} on Ray Serve at http://{cfg.host}:{cfg.port}/v1 "
                  f"({f'{autoscale[0]}..{autoscale[1]} replicas' if autoscale else f'{replicas} replicas'})", file=sys.stderr, flush=True)  # fmt: skip
            if address:
                return 0
            stopping.wait()
        if startup.ray_up.wait(60):
            install()  # a SIGTERM during ray.init: its handler again
        startup.stop_serve(cfg.grace_period + 15)
    finally:
        if not address:
            shut_down_local(startup)
        startup.close()
    return 0


class Startup:
    """``ray.init``, ``serve.start`` and ``serve.run`` on a daemon thread of their own, so that
    the main thread keeps its signal handler and can stop at any step. ``ray_up`` is set once
    ``ray.init`` has returned (or failed); ``wake`` once the whole start-up has ended, with
    ``error`` what it raised. Steps not yet begun are skipped once ``stopping`` is set.

    The thread then waits for ``close``: a local instance's GCS and raylet are its children,
    started with ``PR_SET_PDEATHSIG`` (Ray's ``set_kill_on_parent_death_linux``), and Linux
    sends that signal when the *thread* that started them ends, not the process. A thread that
    returned after ``serve.run`` killed them a few seconds after start-up, and the server a
    minute later."""

    def __init__(self, cfg: ServeConfig, app, address: str | None, stopping: threading.Event, wake: threading.Event,
                 proxy_location: str = "EveryNode"):  # fmt: skip
        self.cfg, self.app, self.address, self.stopping, self.wake = cfg, app, address, stopping, wake
        self.proxy_location = proxy_location
        self.ray_up = threading.Event()
        self.finished = threading.Event()  # the start-up steps have ended (the thread lives on until close)
        self.release = threading.Event()
        self.serve_started = False  # serve.shutdown with no Serve instance waits on Ray for long
        self.error: BaseException | None = None
        # Ray says it sets no SIGTERM handler off the main thread: here that is the point.
        self.quiet = _Drop("SIGTERM handler is not set")
        logging.getLogger("ray._private.worker").addFilter(self.quiet)
        self.thread = threading.Thread(target=self._run, name="specdec-ray-start", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cfg = self.cfg
        try:
            if self.address:
                ray.init(address=self.address, include_dashboard=False)
            else:  # a local instance; on loopback only when the server is
                ray.init(include_dashboard=False, **({"_node_ip_address": "127.0.0.1"} if is_loopback(cfg.host) else {}))
            self.ray_up.set()
            if not self.stopping.is_set():
                self.serve_started = True
                serve.start(proxy_location=self.proxy_location, http_options={"host": cfg.host, "port": cfg.port})
            if not self.stopping.is_set():
                serve.run(self.app, name="specdec", route_prefix="/")
        except BaseException as e:  # noqa: BLE001 -- raised again on the main thread
            self.error = e
        finally:
            self.ray_up.set()
            self.finished.set()
            self.wake.set()
        self.release.wait()  # Ray's processes die with this thread (see the class docstring)

    def stop_serve(self, seconds: float) -> None:
        """Serve's graceful shutdown (replicas finish what it allows, also mid-roll-out), then the
        start-up thread's end: a ``serve.run`` still waiting for the roll-out fails once the
        controller is gone, and must end before ``ray.shutdown``, or Serve would start a new
        local Ray for it (whose processes outlive us). Bounded: when a service manager signals
        the process group, Ray's own processes may already be gone."""
        for _ in range(3):  # the thread may have passed its stopping check just as we shut down
            if self.serve_started and ray.is_initialized():
                bounded(serve.shutdown, seconds)
            if self.finished.wait(15):
                return

    def close(self) -> None:
        """After ``ray.shutdown``: the thread may end (and with it, what is left of Ray's processes)."""
        self.release.set()
        self.thread.join(5)
        logging.getLogger("ray._private.worker").removeFilter(self.quiet)


class _Drop(logging.Filter):
    """Drops log records whose message contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def shut_down_local(startup: Startup) -> None:
    """End the local Ray instance ``run`` started: Ray's own shutdown, bounded, then every process
    of its session still running, including those a start-up step started meanwhile."""
    session = session_dir()
    ours = session_processes(session)
    # Long enough for Ray's own teardown (15-30 s here when stopped during start-up): what
    # is reaped while it still runs (the GCS) makes its core worker abort the exit 60 s later.
    bounded(ray.shutdown, 90)
    reap(ours)
    # A start-up step still running then (serve.start on a loaded box) may have started
    # processes since (Serve's controller and proxy): let it end, then end those too.
    startup.finished.wait(30)
    reap(session_processes(session))


def session_dir() -> str | None:
    """The session folder of this process's Ray instance, while it is up."""
    node = getattr(ray._private.worker, "_global_node", None)
    return node.get_session_dir_path() if node is not None else None


def session_processes(session: str | None) -> list:
    """The processes of this process's local Ray instance: those it started (GCS, raylet, ...),
    and any holding a file of its session folder open (Ray's agents rename themselves
    ``ray::...`` and may be re-parented to init)."""
    import psutil  # Ray's own dependency

    ours = {p.pid: p for p in psutil.Process().children(recursive=True)}
    if session:
        for p in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.Error):
                if p.pid not in ours and (p.info["name"] or "").startswith("ray::") and any(f.path.startswith(session) for f in p.open_files()):
                    ours[p.pid] = p
    return list(ours.values())


def reap(procs: list, seconds: float = 5.0) -> None:
    """End what is left of ``procs`` after ``ray.shutdown``: when the raylet goes down before
    its agents are done starting, they wait a minute on a GCS that is gone before they exit."""
    import psutil

    alive = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running():
                p.terminate()
                alive.append(p)
    _, alive = psutil.wait_procs(alive, timeout=seconds)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def bounded(fn, seconds: float) -> None:
    """Run ``fn`` in a daemon thread for at most ``seconds`` (a shutdown must not hang the exit)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
