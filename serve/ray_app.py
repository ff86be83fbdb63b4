"""specdec on Ray Serve: the same OpenAI routes on many replicas, behind Ray Serve's HTTP proxy.

Each replica is one ``SpecdecReplica`` actor: it checks the bundle (manifest, paths and every
graph's sha256, as ``specdec serve`` does), loads and warms a ``BatchEngine``, and serves the
app of ``specdec.serve.app`` over it (the same request handling, not a second implementation).
Ray Serve routes requests to replicas, bounds their queues (``max_ongoing_requests``,
``max_queued_requests``; see SLACK below), calls ``check_health`` (a replica
whose engine thread died reports unhealthy and is replaced) and restarts dead replicas.

    specdec serve BUNDLE --ray --replicas 2              # a local Ray instance on this machine
    specdec serve BUNDLE --ray --ray-address auto        # onto a running cluster
    serve run docs/ray/serve_config.yaml                 # or a config, without the specdec CLI

``app_builder`` is the application builder such a config names (``import_path``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ray import serve

from specdec.errors import ConfigError
from specdec.manifest import load_manifest
from specdec.serve.app import build_app
from specdec.serve.server import ServeConfig, is_loopback, load_engine, prepare

# Back-pressure is the engine's, as in `specdec serve`: a replica takes every request its engine
# can hold (rows + queue) plus SLACK that are being answered 503 at once, so a full engine answers
# with the OpenAI error body and Retry-After. Ray's own proxy queue (MAX_QUEUED) is only a safety
# net: past it Ray answers a plain-text 503.
SLACK = 8
MAX_QUEUED = 64


@serve.ingress()
class SpecdecReplica:
    """One replica: the bundle loaded once, a batched engine, the OpenAI routes."""

    def __init__(self, config: dict):
        cfg = ServeConfig(**config)
        self.state = prepare(cfg, bind=False)  # the bundle's hashes are checked here, on this replica's machine
        self.state.engine = load_engine(cfg, self.state)  # loaded and warmed before the replica is ready
        replica = serve.get_replica_context().replica_id.unique_id
        self.state.fingerprint = f"specdec-replica-{replica}"
        self.state.metrics.replica(replica)

    def __serve_build_asgi_app__(self):
        return build_app(self.state)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        if not self.state.engine.alive:
            raise RuntimeError("the batch engine's thread has stopped")

    def __del__(self):
        engine = getattr(getattr(self, "state", None), "engine", None)
        if engine is not None:
            engine.close()


def parse_autoscale(text: str) -> tuple[int, int]:
    """``--autoscale MIN:MAX`` as two replica counts."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--autoscale {text!r}: expected MIN:MAX replica counts such as 1:4") from None
    if not 0 <= lo <= hi or hi < 1:
        raise ConfigError(f"--autoscale {text!r}: expected 0 <= MIN <= MAX and MAX >= 1")
    return lo, hi


def application(cfg: ServeConfig, replicas: int = 1, autoscale: tuple[int, int] | None = None, num_cpus: float = 1.0,
                max_ongoing: int | None = None, max_queued: int = MAX_QUEUED):  # fmt: skip
    """The Ray Serve application: ``replicas`` copies (or autoscaling between ``autoscale``).
    ``max_ongoing`` (requests per replica) defaults to what its engine holds + SLACK."""
    if replicas < 1:
        raise ConfigError(f"--replicas {replicas}: expected >= 1")
    rows = cfg.max_batch or load_manifest(cfg.bundle, verify_hashes=False).max_batch
    if max_ongoing is None:
        max_ongoing = rows + cfg.max_queue + SLACK
    scale: dict[str, Any] = {"num_replicas": replicas}
    if autoscale:
        scale = {"autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1], "target_ongoing_requests": rows}}  # scale up once requests queue for rows
    config = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    config["bundle"] = Path(cfg.bundle).resolve()  # replicas do not share the driver's working directory
    deployment = serve.deployment(SpecdecReplica, name="specdec", max_ongoing_requests=max_ongoing, max_queued_requests=max_queued,
                                  ray_actor_options={"num_cpus": num_cpus}, health_check_period_s=5, **scale)  # fmt: skip
    return deployment.bind(config)


def app_builder(args: dict[str, Any]):
    """For ``serve run`` / ``serve deploy`` configs: ``args`` holds ``bundle`` and any other
    ``ServeConfig`` field, plus ``replicas``, ``autoscale`` ("MIN:MAX"), ``num_cpus``,
    ``max_ongoing_requests`` and ``max_queued_requests``."""
    args = dict(args)
    if "bundle" not in args:
        raise ConfigError("the application's args need a bundle: args: {bundle: /path/to/bundle}")
    kw = dict(replicas=int(args.pop("replicas", 1)), num_cpus=float(args.pop("num_cpus", 1.0)),
              max_queued=int(args.pop("max_queued_requests", MAX_QUEUED)))  # fmt: skip
    if "max_ongoing_requests" in args:
        kw["max_ongoing"] = int(args.pop("max_ongoing_requests"))
    if "autoscale" in args:
        kw["autoscale"] = parse_autoscale(str(args.pop("autoscale")))
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"application args {unknown}: unknown; expected bundle and the specdec serve options ({', '.join(sorted(known))})")
    args["bundle"] = Path(args["bundle"])
    return application(ServeConfig(**args), **kw)


def run(cfg: ServeConfig, replicas: int = 1, autoscale: tuple[int, int] | None = None, address: str | None = None,
        num_cpus: float = 1.0) -> int:  # fmt: skip
    """``specdec serve --ray``. Without ``address``: start a local Ray instance, serve until
    SIGTERM/SIGINT, then shut Serve and Ray down. With one: deploy onto that cluster and return
    (the application keeps running there; ``serve shutdown`` removes it)."""
    import signal
    import sys
    import threading

    import ray

    prepare(cfg)  # refuse a bad bundle or option before starting anything (one line, exit 2)
    app = application(cfg, replicas, autoscale, num_cpus)
    if address:
        ray.init(address=address, include_dashboard=False)
    else:  # a local instance; on loopback only when the server is
        ray.init(include_dashboard=False, **({"_node_ip_address": "127.0.0.1"} if is_loopback(cfg.host) else {}))
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(app, name="specdec", route_prefix="/")
        print(f"specdec: {cfg.served_model_name or Path(cfg.bundle).resolve().name} on Ray Serve at http://{cfg.host}:{cfg.port}/v1 "
              f"({f'{autoscale[0]}..{autoscale[1]} replicas' if autoscale else f'{replicas} replicas'})", file=sys.stderr, flush=True)  # fmt: skip
        if address:
            return 0
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        # Replicas finish what Ray Serve's graceful shutdown allows. Bounded: when a service
        # manager signals the whole process group, Ray's own processes may already be gone.
        bounded(serve.shutdown, cfg.grace_period + 15)
    finally:
        if not address:
            bounded(ray.shutdown, 30)
    return 0


def bounded(fn, seconds: float) -> None:
    """Run ``fn`` in a daemon thread for at most ``seconds`` (a shutdown must not hang the exit)."""
    import threading

    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
