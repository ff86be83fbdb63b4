"""``specdec serve``: check the bundle, bind at once, load and warm the engine, serve until SIGTERM.

The port answers from the start (``/health`` is 503 until the engine is loaded and warmed), so an
orchestrator can tell "loading" from "dead". SIGTERM or Ctrl-C: uvicorn stops accepting
connections, lets the requests in flight finish (up to ``grace_period`` seconds), then the
engine is closed and the process exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from specdec import __version__
from specdec.errors import ConfigError
from specdec.manifest import load_manifest
from specdec.runtime.batch import BatchEngine
from specdec.runtime.drafters import bundle_default
from specdec.runtime.gamma import resolve as resolve_gamma
from specdec.runtime.text import TextCodec
from specdec.store import fetch, is_uri, name_of
from specdec.serve.app import ServerState, build_app
from specdec.serve.chat import bundle_template
from specdec.serve.metrics import Metrics

log = logging.getLogger("specdec.serve")


@dataclass(frozen=True)
class ServeConfig:
    bundle: Path  # or a stored bundle's URI (s3://, https://, ...): local_bundle fetches it
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int | None = None  # None: the bundle's --max-batch
    max_queue: int = 64
    drafter: str | None = None  # None: the bundle's default (manifest.default_drafter())
    gamma: int | str | None = "auto"  # "auto": adaptive (a seeded sampled request keeps the bundle's); None: the bundle's γ (its default drafter's)
    served_model_name: str | None = None  # None: the bundle folder's name
    chat_template: Path | None = None  # None: the bundle's
    threads: int | None = None
    provider: str = "cpu"  # ONNX Runtime provider: "cpu", "cuda" or "cuda-graph"
    draft_provider: str | None = None  # the draft model's and the feature head's, where not ``provider``'s
    verify: str = "full"  # the bundle's files: "full" digests, or "size" only (a trusted bundle, fast start)
    api_key: str | tuple[str, ...] | None = None  # one key or several (a tenant each); None: no key asked
    isolate_tenants: bool = False  # prefix reuse only within a key's requests: the cache salt derived from it
    spec_decode_metrics: str = "none"  # vLLM's --per-request-spec-decode-metrics: "summary" adds metrics.speculative_decoding
    grace_period: float = 30.0  # seconds SIGTERM waits for requests in flight
    log_level: str = "info"
    logprobs_mode: str = "raw_logprobs"  # vLLM's names: raw_logprobs, or processed_logprobs (the distribution sampled)
    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*": any); none: no CORS headers
    prefix_reuse: bool = True  # a request keeps the prefix of its prompt an idle slot holds
    cache_slots: int | None = None  # KV slots (>= max_batch); None: max_batch


SPEC_DECODE_METRICS = ("none", "summary")  # vLLM's --per-request-spec-decode-metrics (its "detailed" per-step lists are not kept)
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}  # vLLM's --logprobs-mode -> SamplingParams.logprobs_mode


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def security_warning(host: str, api_key: str | None) -> str | None:
    """What to print when the server can be reached from other machines without a key."""
    if is_loopback(host) or api_key:
        return None
    return (f"WARNING: specdec serve is listening on {host} without authentication: anyone who can reach it can use it; "
            "set --api-key or SPECDEC_API_KEY")  # fmt: skip


def local_bundle(cfg: ServeConfig) -> ServeConfig:
    """``cfg`` with its bundle on this machine: a stored bundle's URI (s3://, https://, ...) is
    fetched into this node's verified cache once (specdec/store.py), and the model keeps the
    URI's last part as its name."""
    if not is_uri(cfg.bundle):
        return cfg
    uri = str(cfg.bundle)
    return dataclasses.replace(cfg, bundle=fetch(uri), served_model_name=cfg.served_model_name or name_of(uri))


def prepare(cfg: ServeConfig, bind: bool = True) -> ServerState:
    """Everything that can be refused before binding: the bundle, the chat template, the options
    (and, with ``bind``, whether the address can be bound)."""
    m = load_manifest(cfg.bundle, cfg.verify)
    if cfg.port < 0 or cfg.port > 65535:
        raise ConfigError(f"--port {cfg.port}: expected 0..65535")
    if cfg.grace_period < 0:
        raise ConfigError(f"--grace-period {cfg.grace_period}: expected seconds >= 0")
    if bind:
        check_bind(cfg.host, cfg.port)
    codec = TextCodec.from_bundle(cfg.bundle, m)
    chat = bundle_template(cfg.bundle, m, codec, cfg.chat_template)
    drafter = cfg.drafter or bundle_default(m)
    BatchEngine.check_options(m, cfg.max_batch, drafter, cfg.max_queue, cfg.cache_slots)
    resolve_gamma(cfg.gamma, m.gamma)  # the --gamma every request will carry
    model = cfg.served_model_name or Path(cfg.bundle).resolve().name
    fingerprint = f"specdec-{__version__}"
    if cfg.logprobs_mode not in LOGPROBS_MODES:
        raise ConfigError(f"--logprobs-mode {cfg.logprobs_mode!r}: expected one of {', '.join(LOGPROBS_MODES)}")
    keys = api_keys(cfg.api_key)
    if cfg.isolate_tenants and not keys:
        raise ConfigError("--isolate-tenants: each tenant's cache salt comes from its API key, and no key is set; pass --api-key KEY (once per tenant)")
    if cfg.spec_decode_metrics not in SPEC_DECODE_METRICS:
        raise ConfigError(f"--per-request-spec-decode-metrics {cfg.spec_decode_metrics!r}: expected one of {', '.join(SPEC_DECODE_METRICS)}")
    return ServerState(model=model, max_seq_len=m.max_seq_len, codec=codec, chat=chat, gamma=cfg.gamma, api_keys=keys, isolate_tenants=cfg.isolate_tenants,
                       spec_decode_metrics=cfg.spec_decode_metrics, fingerprint=fingerprint, manifest=m, logprobs_mode=LOGPROBS_MODES[cfg.logprobs_mode],
                       allowed_origins=tuple(cfg.allowed_origins))  # the manifest is opened and verified once


def api_keys(given: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """The keys a server lets in (``ServeConfig.api_key``: one, several or None); an empty key is refused."""
    keys = (given,) if isinstance(given, str) else tuple(given or ())
    if any(not k for k in keys):
        raise ConfigError("--api-key '': expected a non-empty key (or no --api-key at all)")
    return keys


def load_engine(cfg: ServeConfig, state: ServerState):
    """Load the batched engine, warm every graph it will run, then attach the metrics."""
    engine = BatchEngine(cfg.bundle, max_batch=cfg.max_batch, drafter=cfg.drafter, threads=cfg.threads, max_queue=cfg.max_queue,
                         provider=cfg.provider, draft_provider=cfg.draft_provider, manifest=state.manifest, prefix_reuse=cfg.prefix_reuse, cache_slots=cfg.cache_slots)
    try:
        warm = [0] * 4  # token 0 exists in every vocabulary
        n = max(engine.limits.max_gamma * 2, 4)
        engine.generate_many([warm], max_new_tokens=n, ignore_eos=True, gamma=cfg.gamma)  # the batch-1 graphs
        for rows in engine.manifest.batch_sizes():  # each batched graph the engine may pick
            if rows <= engine.max_batch:
                engine.generate_many([warm] * rows, max_new_tokens=n, ignore_eos=True, gamma=cfg.gamma)
    except Exception:
        engine.close()
        raise
    state.metrics = Metrics(engine.manifest.gamma, engine.max_batch, lambda: engine.active, engine.waiting.qsize)
    state.metrics.prefix_cache(engine.engine)
    engine.observer = state.metrics.observe_iteration
    return engine


def serve(cfg: ServeConfig) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit status (0 after a clean drain)."""
    import uvicorn

    cfg = local_bundle(cfg)
    state = prepare(cfg)
    if warning := security_warning(cfg.host, cfg.api_key):
        print(warning, file=sys.stderr, flush=True)  # whatever the log level
    server = None

    def loader():
        try:
            state.engine = load_engine(cfg, state)
            log.info("specdec: %s ready (max batch %d, queue %d, drafter %s, gamma %s)", state.model, state.engine.max_batch, cfg.max_queue, state.engine.drafter_name, cfg.gamma)
        except Exception as e:
            state.failed = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.error("specdec: loading %s failed: %s", cfg.bundle, state.failed)
            server.should_exit = True

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        threading.Thread(target=loader, name="specdec-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.close()

    app = build_app(state, lifespan)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, timeout_graceful_shutdown=cfg.grace_period, access_log=False))
    # uvicorn re-raises the signal it drained on once it is done; a handler here turns that into
    # a normal return (exit status 0) instead of death by SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if state.failed else 0


def check_bind(host: str, port: int) -> None:
    """Refuse at once an address that cannot be bound (in use, not ours) with a one-line
    ``ConfigError``, rather than uvicorn's log line after loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: cannot resolve it ({e.strerror}); pass an address such as 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot bind ({e.strerror}); choose a free port or another address") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (for tests and benchmarks)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
