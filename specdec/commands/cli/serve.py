"""``specdec serve``: the OpenAI-compatible server, alone or on Ray Serve.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from specdec.commands.cli.options import DRAFT_PROVIDER_OPTION, PROVIDER_OPTION, parse_gamma, thread_policy
from specdec.errors import ConfigError
from specdec.runtime.drafters import DRAFTERS


@click.command("serve")
@click.argument("bundle")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; anything but loopback should have --api-key.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--max-batch", default=None, type=int, help="Requests decoded together [default: the bundle's --max-batch].")
@click.option("--max-queue", default=64, show_default=True, type=int, help="Requests waiting for a row; past it new requests get 503 + Retry-After.")
@click.option("--drafter", default=None, type=click.Choice(list(DRAFTERS)), help="What proposes tokens [default: the bundle's, see specdec inspect].")
@click.option("--gamma", default="auto", show_default=True, help="Draft tokens per target call: auto (chosen each iteration from the "
              "measured costs and each row's acceptance, 0 where speculation does not pay; a seeded sampled request keeps the bundle's "
              "γ, so it reproduces), or 0..the bundle's gamma.")
@PROVIDER_OPTION
@DRAFT_PROVIDER_OPTION
@click.option("--verify", default="full", show_default=True, type=click.Choice(["full", "size"]),
              help="Check the bundle's files: full digests (once per unchanged file), or sizes only for a bundle you trust (changed bytes would run as another model).")
@click.option("--served-model-name", default=None, help="The model name clients send [default: the bundle folder's name].")
@click.option("--chat-template", default=None, type=click.Path(path_type=Path), help="Jinja chat template [default: the bundle's, from its tokenizer].")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per session [default: one per core].")
@click.option("--api-key", multiple=True, envvar="SPECDEC_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health; repeat "
              "for several keys, one per tenant [env: SPECDEC_API_KEY, keys separated by spaces].")
@click.option("--isolate-tenants", is_flag=True, help="Prefix reuse only within one API key's requests: the server derives each key's "
              "cache_salt, so a request never reuses, or starts faster from, another tenant's prompt. Needs --api-key.")
@click.option("--per-request-spec-decode-metrics", "spec_decode_metrics", default="none", show_default=True, type=click.Choice(["none", "summary"]),
              help="summary: each response carries its drafted, accepted and acceptance rate in metrics.speculative_decoding "
                   "(vLLM's field; in the last chunk of a stream). Off by default: strict clients refuse unknown fields.")
@click.option("--grace-period", default=30.0, show_default=True, type=float, help="Seconds SIGTERM lets requests in flight finish.")
@click.option("--logprobs-mode", default="raw_logprobs", show_default=True, type=click.Choice(["raw_logprobs", "processed_logprobs"]),
              help="Logprobs from the raw logits, or from the distribution sampled (after penalties, temperature, top-k/p, min-p), as vLLM's.")
@click.option("--allowed-origins", multiple=True, help="Allow browsers from this origin (CORS; repeat, or '*'); off by default.")
@click.option("--prefix-reuse/--no-prefix-reuse", default=True, show_default=True, help="A request keeps the prefix of its prompt that an idle KV slot holds (multi-turn chat).")
@click.option("--cache-slots", default=None, type=int, help="KV slots allocated at load, >= --max-batch: more keep more conversations [default: --max-batch].")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--check", "run_check", is_flag=True, help="First run specdec check --quick on this box; refuse to start if the bundle fails it.")
@click.option("--ray", "use_ray", is_flag=True, help="Serve on Ray Serve: replicas behind Ray's HTTP proxy (the ray extra).")
@click.option("--replicas", default=1, show_default=True, type=int, help="With --ray: replicas, each loading the bundle once.")
@click.option("--autoscale", default=None, help="With --ray: MIN:MAX replicas, scaled on ongoing requests (instead of --replicas).")
@click.option("--ray-address", default=None, help="With --ray: 'auto' or ADDR deploys onto a running cluster [default: start a local Ray instance].")
@click.option("--replica-cpus", default=1.0, show_default=True, type=float, help="With --ray: CPUs Ray reserves per replica.")
@click.option("--proxy-location", default="EveryNode", show_default=True, type=click.Choice(["EveryNode", "HeadOnly"]),
              help="With --ray: Ray Serve's HTTP proxy on every node (behind your load balancer), or on the head node only.")
def serve_cmd(bundle: str, gamma: str | None, run_check: bool, use_ray: bool, replicas: int, autoscale: str | None, ray_address: str | None,
              replica_cpus: float, proxy_location: str, **kw) -> None:  # fmt: skip
    """An OpenAI-compatible server (completions, chat, SSE streaming, /metrics) over the batched engine.

    BUNDLE is the folder specdec-export wrote, or a stored bundle's URI (s3://, https://, ...;
    see specdec push), fetched once per machine into a verified cache."""
    from specdec.store import is_uri

    bundle = bundle if is_uri(bundle) else Path(bundle)
    try:
        from specdec.serve.server import ServeConfig, local_bundle, serve
    except ImportError as e:
        raise ConfigError(f"specdec serve needs the serve extra ({e.name} is missing): pip install 'specdec[serve]'") from None
    logging.basicConfig(level=kw["log_level"].upper(), format="%(levelname)s: %(message)s")
    cfg = ServeConfig(bundle, gamma=parse_gamma(gamma), **kw)
    if run_check:
        _check_before_serving(local_bundle(cfg).bundle, kw["threads"])
    if not use_ray:
        if (replicas, autoscale, ray_address) != (1, None, None):
            raise ConfigError("--replicas, --autoscale and --ray-address need --ray")
        sys.exit(serve(cfg))
    try:
        from specdec.serve import ray_app
    except ImportError as e:
        raise ConfigError(f"specdec serve --ray needs the ray extra ({e.name} is missing): pip install 'specdec[ray]'") from None
    scale = ray_app.parse_autoscale(autoscale) if autoscale else None
    sys.exit(ray_app.run(cfg, replicas, scale, ray_address, replica_cpus, proxy_location))


def _check_before_serving(bundle: Path, threads: int | None) -> None:
    """``specdec serve --check``: the quick check, its verdict logged; a failure refuses to serve."""
    from specdec.commands import check
    from specdec.errors import BundleError

    items, seconds = check.timed(check.run, bundle, quick=True, threads=thread_policy(threads))
    failed = [i for i in items if i.ok is False]
    if failed:
        f = failed[0]
        raise BundleError(f"{bundle} failed specdec check --quick ({f.section}, {f.name}): {f.detail}; {f.fix}")
    advice = next((i.detail for i in items if i.name == "advice"), "")
    logging.getLogger("specdec.serve").info("specdec check --quick passed in %.0f s (%d checks); %s", seconds, sum(i.ok is True for i in items), advice)
