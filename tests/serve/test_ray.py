"""specdec on Ray Serve: a local Ray instance (2 CPUs, loopback only), 2 replicas of the test bundle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from specdec.serve.server import ServeConfig, free_port  # noqa: E402

# Every test here starts or needs the only Ray on the machine (the SIGTERM tests assert none is
# running): one worker runs them all, in turn, under --dist loadgroup.
pytestmark = pytest.mark.xdist_group("ray")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def add(a, b):", "class Stack:\n", "import os\n"]


def ray_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "raylet|gcs_server|ray::|ServeController|ServeReplica"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def log_has(server, text: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and server.proc.poll() is None:
        if text in server.log.read_text():
            return True
        time.sleep(0.05)
    return text in server.log.read_text()


def no_ray_left(within: float = 30.0) -> list[str]:
    deadline = time.monotonic() + within
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    return ray_processes()


# First in this module, before ``cluster`` starts Ray in the test process: each test here runs
# ``specdec serve --ray`` as a process with a local Ray instance of its own.


@pytest.mark.parametrize("moment", ["idle", "start-up", "roll-out under load"])
def test_sigterm_at_any_moment_shuts_down_gracefully(chat_bundle, tmp_path, moment):
    """SIGTERM to ``specdec serve --ray`` exits 0 with nothing of Ray left behind, whenever it
    comes: during start-up (Ray starting), during the roll-out with 8 requests in flight as soon
    as /health answers (the second replica cannot be placed, so the roll-out never ends: Ray's
    own handler would exit 15 there without a drain), and idle with one replica. Requests in
    flight are answered or fail with a connection error, never hang."""
    from specdec.serve.process import ServerProcess

    assert not ray_processes(), "Ray is already running here"
    cpus = os.cpu_count() or 2
    args = ["--ray", "--threads", "1", "--served-model-name", "tiny"]
    args += ["--replicas", "1"] if moment == "idle" else ["--replicas", "2", "--replica-cpus", f"{0.6 * cpus:g}"]  # one fits
    with ServerProcess(chat_bundle[1], *args, log=tmp_path / "serve.log") as s:
        answers = []
        if moment == "start-up":
            assert log_has(s, "starting a local Ray instance", 120), s.log.read_text()
            time.sleep(1.0)  # within ray.init
        else:
            s.wait_ready(180)
            if moment == "idle":  # Ray's GCS and raylet outlive the start-up thread (PR_SET_PDEATHSIG: they died with it)
                assert log_has(s, "on Ray Serve at", 60), s.log.read_text()
                time.sleep(3.0)
                import psutil

                alive = {p.name() for p in psutil.Process(s.proc.pid).children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}
                assert {"gcs_server", "raylet"} <= alive, alive
                assert openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60).models.list().data
            if moment != "idle":
                client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)

                def ask(i: int):
                    try:
                        return client.completions.create(model="tiny", prompt=PROMPTS[i % 3], max_tokens=24, temperature=0).choices[0].text
                    except openai.APIConnectionError as e:
                        return e

                import concurrent.futures as cf

                pool = cf.ThreadPoolExecutor(8)
                futures = [pool.submit(ask, i) for i in range(8)]
                time.sleep(0.2)
                assert "on Ray Serve at" not in s.log.read_text(), "the roll-out ended: this is not the moment under test"
        rc = s.stop(timeout=120)
        if moment.startswith("roll-out"):
            answers = [f.result(timeout=60) for f in futures]  # bounded: none hangs
            pool.shutdown()
        assert rc == 0, f"{moment}: exit {rc}\n{s.log.read_text()[-3000:]}"
        assert "SIGTERM received" not in s.log.read_text()  # Ray's C++ handler was not the one that ran
    assert all(isinstance(a, (str, openai.APIConnectionError)) for a in answers), answers
    assert not no_ray_left(), ray_processes()


@pytest.fixture(scope="module")
def store_cache(tmp_path_factory):
    """The bundle cache every process of this module's Ray instance uses (its workers inherit it)."""
    folder = tmp_path_factory.mktemp("store-cache")
    saved = os.environ.get("SPECDEC_CACHE")
    os.environ["SPECDEC_CACHE"] = str(folder)
    yield folder
    if saved is None:
        os.environ.pop("SPECDEC_CACHE", None)
    else:
        os.environ["SPECDEC_CACHE"] = saved


@pytest.fixture(scope="module")
def cluster(chat_bundle, s3, store_cache):
    """A local Ray instance with 2 CPUs, Serve's proxy on a free 127.0.0.1 port, 2 replicas
    (half a CPU and one ORT thread each) of the test bundle pulled from an S3-compatible store
    (``specdec push``; each replica fetches it into its node's cache). Torn down at the end
    (see the last test)."""
    from specdec.serve.ray_app import application
    from specdec.store import push

    assert not ray_processes(), "Ray is already running here"
    push(chat_bundle[1], "s3://models/tiny-chat", progress=False)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ServeConfig("s3://models/tiny-chat", host="127.0.0.1", port=port, threads=1, served_model_name="tiny", max_batch=4)
        serve.run(application(cfg, replicas=2, num_cpus=0.5), name="specdec", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_replicas_pulled_the_bundle_from_the_store_once(cluster, store_cache):
    """One node: the driver and both replicas share one verified copy, fetched once."""
    kept = [p.name for p in (store_cache / "bundles").iterdir() if not p.name.endswith(".lock")]
    assert len(kept) == 1 and not kept[0].endswith(".partial"), kept


@pytest.fixture(scope="module")
def reference(chat_bundle):
    from specdec.runtime.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder.load(chat_bundle[1])
    return lambda prompt, n: dec.generate(prompt, max_new_tokens=n, ignore_eos=True).tokens


def replicas() -> dict[str, str]:
    """Replica id -> actor name of the running specdec replicas."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::specdec#specdec#"):
            out[a["name"].rsplit("#", 1)[1]] = a["name"]
    return out


def running() -> int:
    return serve.status().applications["specdec"].deployments["specdec"].replica_states.get("RUNNING", 0)


async def spread(url: str, n: int) -> list:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        return await asyncio.gather(*(c.completions.create(model="tiny", prompt=PROMPTS[i % 3], max_tokens=24, temperature=0,
                                                           extra_body={"ignore_eos": True, "return_token_ids": True}) for i in range(n)))  # fmt: skip
    finally:
        await c.close()


def test_replicas_serve_the_targets_greedy_tokens_and_share_the_load(cluster, reference):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="x", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == reference(prompt, 40)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))  # fmt: skip
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == reference(PROMPTS[0], 40)
    got = asyncio.run(spread(cluster, 16))
    for i, r in enumerate(got):
        assert r.choices[0].model_extra["token_ids"] == reference(PROMPTS[i % 3], 24)
    per_replica = {fp: sum(r.system_fingerprint == fp for r in got) for fp in {r.system_fingerprint for r in got}}
    assert len(per_replica) == 2 and all(n > 0 for n in per_replica.values()), per_replica
    assert {fp.rsplit("-", 1)[1] for fp in per_replica} == set(replicas())


def test_a_killed_replica_is_replaced_and_the_survivor_answers(cluster, reference):
    before = replicas()
    assert len(before) == 2
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="x", max_retries=0, timeout=120)
    for i in range(6):  # right after the kill: a request routed to the dead one is retried by the front on the survivor
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == reference(PROMPTS[0], 16)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (running() == 2 and victim not in replicas() and len(replicas()) == 2):
        time.sleep(0.5)
    now = replicas()
    assert running() == 2 and victim not in now and len(now) == 2, (before, now)
    # the new replica takes requests too, once the proxy's router has heard of it (a long poll:
    # under load, a few seconds after the replica reports RUNNING)
    seen: set = set()
    deadline = time.monotonic() + 60
    while seen != set(now) and time.monotonic() < deadline:
        got = asyncio.run(spread(cluster, 16))
        assert all(r.choices[0].model_extra["token_ids"] == reference(PROMPTS[i % 3], 24) for i, r in enumerate(got))
        seen |= {r.system_fingerprint.rsplit("-", 1)[1] for r in got}
    assert seen == set(now), (seen, now)


def test_a_full_replica_answers_503_with_the_servers_error_body(cluster, slow_bundle):
    """Redeployed as 1 replica with 1 row and 1 queue place (slow bundle, plain decoding): of 8
    concurrent requests the overflow gets the engine's 503 (OpenAI body, Retry-After), not Ray's
    plain-text one, and the replica serves again afterwards."""
    import httpx

    from specdec.serve.ray_app import application

    port = int(cluster.rsplit(":", 1)[1])
    cfg = ServeConfig(slow_bundle, host="127.0.0.1", port=port, threads=1, served_model_name="tiny", max_batch=1, max_queue=1, gamma=0)
    serve.run(application(cfg, replicas=1, num_cpus=0.5), name="specdec", route_prefix="/")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=cluster, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(8)))

    got = asyncio.run(main())
    codes = [r.status_code for r in got]
    assert set(codes) <= {200, 503} and codes.count(503) >= 5 and codes.count(200) >= 1, codes
    for r in got:
        if r.status_code == 503:
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "queue_full"
    assert httpx.post(cluster + "/v1/completions", json={**body, "max_tokens": 8}, timeout=60).status_code == 200


def test_a_replica_killed_mid_request_leaves_openai_answers(cluster, slow_bundle):
    """Redeployed as 1 replica of the slow bundle, 1 row: the replica is killed while a request
    is being decoded. A completion (sent whole when done) is retried by the front on the
    replacement replica: 200, the same greedy tokens as when nothing fails. A stream under way
    ends with an OpenAI error event. Never Ray's plain-text 500."""
    import threading

    import httpx

    from specdec.serve.ray_app import application

    port = int(cluster.rsplit(":", 1)[1])
    cfg = ServeConfig(slow_bundle, host="127.0.0.1", port=port, threads=1, served_model_name="tiny", max_batch=1, gamma=0)
    serve.run(application(cfg, replicas=1, num_cpus=0.5), name="specdec", route_prefix="/")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 480, "n": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def kill_the_replica(spare: str = "") -> str:
        deadline = time.monotonic() + 120
        while not (alive := {k: v for k, v in replicas().items() if k != spare}) and time.monotonic() < deadline:
            time.sleep(0.2)
        (rid, name), = alive.items()
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return rid

    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=httpx.post(cluster + "/v1/completions", json=body, timeout=180)))
    t.start()
    time.sleep(1.0)  # 6 choices of 480 tokens, one row: seconds of decoding, the kill lands in them
    killed = kill_the_replica()
    t.join(200)
    r = got["r"]
    assert r.status_code == 200, r.text[:200]
    assert not r.json()["system_fingerprint"].endswith(killed)  # answered by the replacement
    again = httpx.post(cluster + "/v1/completions", json=body, timeout=180).json()
    assert [c["token_ids"] for c in r.json()["choices"]] == [c["token_ids"] for c in again["choices"]]

    lines = []
    with httpx.stream("POST", cluster + "/v1/completions", json={**body, "stream": True}, timeout=180) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            lines.append(line)
            if len(lines) == 5:
                kill_the_replica(spare=killed)
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events and "choices" in events[0] and "error" in events[-1], lines[-3:]
    assert events[-1]["error"]["code"] == "replica_unavailable" and events[-1]["error"]["type"] == "server_error"
    assert all(x == "" or x.startswith("data: ") for x in lines), [x for x in lines if x and not x.startswith("data: ")][:2]


def test_config_file_and_builder(chat_bundle):
    """The documented ``serve run`` config names a builder that builds the application; bad
    args are refused in one line."""
    import yaml

    from specdec.errors import ConfigError
    from specdec.serve import ray_app

    config = yaml.safe_load((ROOT / "docs/ray/serve_config.yaml").read_text())
    app_cfg = config["applications"][0]
    module, name = app_cfg["import_path"].split(":")
    assert getattr(__import__(module, fromlist=[name]), name) is ray_app.app_builder
    args = {**app_cfg["args"], "bundle": str(chat_bundle[1])}
    assert isinstance(ray_app.app_builder(args), serve.Application)
    assert isinstance(ray_app.app_builder({**args, "autoscale": "1:3"}), serve.Application)
    for bad, names in (({**args, "colour": 1}, "colour"), ({k: v for k, v in args.items() if k != "bundle"}, "bundle"), ({**args, "autoscale": "4"}, "autoscale")):
        with pytest.raises(ConfigError, match=names):
            ray_app.app_builder(bad)


def test_ray_options_need_ray(chat_bundle):
    r = subprocess.run([sys.executable, "-m", "specdec", "serve", str(chat_bundle[1]), "--replicas", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--ray" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_teardown_leaves_no_ray_processes(cluster):
    """Last: shut Serve and Ray down; no Ray process is left (bounded wait)."""
    serve.shutdown()
    ray.shutdown()
    deadline = time.monotonic() + 30
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes(), ray_processes()


# -- two nodes on this box: after the single-node tests above have torn their Ray down --------------


def ray_cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], capture_output=True, text=True, env=env, timeout=timeout)


def start_node(address: str | None, name: str, env: dict, cache: Path) -> None:
    """A Ray node (``ray start``: its own raylet) with 1 CPU, a custom resource ``name`` and its
    own bundle cache, so each node fetches the bundle from the store itself."""
    env = {**env, "SPECDEC_CACHE": str(cache)}
    where = ["--address", address] if address else ["--head", "--port", address_port(env), "--include-dashboard", "false"]
    r = ray_cli("start", *where, "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--resources", f'{{"{name}": 1}}', "--disable-usage-stats", env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def address_port(env: dict) -> str:
    return env["SPECDEC_TEST_RAY_PORT"]


def node_raylet(name: str):
    import psutil

    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "raylet" and f"{name},1" in " ".join(p.info["cmdline"] or ()):
            return p
    return None


@pytest.fixture(scope="module")
def two_nodes(chat_bundle, s3, tmp_path_factory):
    """A head node and a second node, each its own raylet (1 CPU, resource node_a / node_b, a
    bundle cache of its own), token-authenticated on 127.0.0.1; ``specdec serve s3://… --ray
    --ray-address`` deploys 2 replicas of the pushed bundle onto it (one fits a node). Yields
    (url, env, caches, root). Torn down with ``ray stop`` (no other Ray runs during this module)."""
    import secrets

    from specdec.store import push

    assert not no_ray_left(30), "Ray is still running here"
    root = tmp_path_factory.mktemp("two-nodes")
    push(chat_bundle[1], "s3://models/tiny-chat-2n", progress=False)
    env = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_CACHE", "PYTEST_CURRENT_TEST")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), SPECDEC_TEST_RAY_PORT=str(free_port()))
    caches = {"node_a": root / "cache-a", "node_b": root / "cache-b"}
    address = f"127.0.0.1:{env['SPECDEC_TEST_RAY_PORT']}"
    try:
        start_node(None, "node_a", env, caches["node_a"])
        start_node(address, "node_b", env, caches["node_b"])
        port = free_port()
        r = subprocess.run([sys.executable, "-m", "specdec", "serve", "s3://models/tiny-chat-2n", "--ray", "--ray-address", address,
                            "--replicas", "2", "--replica-cpus", "1", "--proxy-location", "HeadOnly", "--host", "127.0.0.1",
                            "--port", str(port), "--threads", "1", "--served-model-name", "tiny", "--max-batch", "4"],
                           capture_output=True, text=True, env={**env, "SPECDEC_CACHE": str(root / "cache-driver")}, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        yield f"http://127.0.0.1:{port}", env, caches, address
    finally:
        ray_cli("stop", "--force", env=env, timeout=60)


def ask(url: str, prompt: str, timeout: float = 30):
    """(status, body) of one greedy completion; status 0 when no HTTP answer came."""
    import httpx

    try:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                      "ignore_eos": True, "return_token_ids": True}, timeout=timeout)  # fmt: skip
        return r.status_code, r.text
    except httpx.HTTPError as e:
        return 0, repr(e)


def test_two_nodes_serve_exact_tokens_from_replicas_that_each_pulled_the_bundle(two_nodes, reference):
    url, _, caches, _ = two_nodes
    for name, cache in caches.items():  # each node fetched it into its own cache: a replica ran there
        kept = [p for p in (cache / "bundles").iterdir() if p.is_dir() and not p.name.endswith(".partial")]
        assert len(kept) == 1, (name, list((cache / "bundles").iterdir()))
    for i in range(8):
        status, body = ask(url, PROMPTS[i % 3])
        assert status == 200, body
        assert json.loads(body)["choices"][0]["token_ids"] == reference(PROMPTS[i % 3], 16)


def test_a_lost_node_leaves_the_service_answering_and_its_replica_returns(two_nodes, reference, record_property):
    """Node B's raylet and workers are killed under load: requests keep being answered (a bounded
    number fail while Ray notices), then node B rejoins and its replica comes back. What failed,
    and how, is recorded (docs/scaling-out.md)."""
    import concurrent.futures as cf

    import psutil

    url, env, caches, address = two_nodes
    raylet = node_raylet("node_b")
    assert raylet is not None
    results: list[tuple[float, int, str, str]] = []  # (seconds since start, status, body, prompt)
    t0 = time.monotonic()

    def load(k: int):
        for i in range(10_000):  # bounded in count and in time
            if time.monotonic() - t0 > 20:
                return
            prompt = PROMPTS[(k + i) % 3]
            status, body = ask(url, prompt)
            results.append((time.monotonic() - t0, status, body, prompt))

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, k) for k in range(4)]
        time.sleep(3)
        killed_at = time.monotonic() - t0
        victims = [raylet, *raylet.children(recursive=True)]
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.kill()
        for f in futures:
            f.result(timeout=120)
    after = [r for r in results if r[0] >= killed_at]
    failed = [r for r in after if r[1] != 200]
    plain = [b[:80] for _, s, b, _ in failed if s and not b.startswith('{"error"')]
    last_failure = max((t for t, *_ in failed), default=killed_at)
    ok_after = [(b, p) for t, s, b, p in after if s == 200 and t > last_failure]
    record_property("node_loss", {"requests_after_kill": len(after), "failed": len(failed), "recovered_after_s": round(last_failure - killed_at, 1),
                                  "non_openai_bodies": len(plain), "statuses": sorted({s for _, s, _, _ in failed})})  # fmt: skip
    print(f"node loss: {len(after)} requests after the kill, {len(failed)} failed (statuses {sorted({s for _, s, _, _ in failed})}, "
          f"{len(plain)} not OpenAI-shaped: {plain[:2]}), "
          f"answering again {last_failure - killed_at:.1f} s after it")  # fmt: skip
    assert ok_after and last_failure - killed_at < 30, failed[-3:]
    assert all(json.loads(b)["choices"][0]["token_ids"] == reference(p, 16) for b, p in ok_after)
    assert len(failed) <= 16, failed[:3]

    assert running_replicas(env, address) <= 1  # the loss was real: Serve counts one replica now
    start_node(address, "node_b", env, caches["node_b"])  # it rejoins: Serve places the second replica there again
    deadline = time.monotonic() + 90
    while (n := running_replicas(env, address)) < 2 and time.monotonic() < deadline:
        time.sleep(2)
    assert n == 2
    assert ask(url, PROMPTS[1])[0] == 200


def running_replicas(env: dict, address: str) -> int:
    """RUNNING replicas of the specdec deployment, as Serve's controller reports them (a driver of its own)."""
    code = ("import ray; from ray import serve; ray.init(address=%r, log_to_driver=False); "
            "print(serve.status().applications['specdec'].deployments['specdec'].replica_states.get('RUNNING', 0))") % address
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


def test_autoscaling_adds_a_replica_on_the_other_node_under_load_and_removes_it_idle(two_nodes, reference, record_property):
    """The same cluster redeployed with ``autoscale: "1:2"`` (short delays): idle it keeps one
    replica; 12 clients in a loop queue past one replica's rows, and Serve adds the second, which
    fits only on the other node (1 CPU each); idle again, it is removed."""
    import concurrent.futures as cf

    url, env, caches, address = two_nodes
    code = ("import sys, ray; from ray import serve; from specdec.serve.ray_app import app_builder; ray.init(address=%r, log_to_driver=False); "
            "serve.run(app_builder(dict(bundle='s3://models/tiny-chat-2n', served_model_name='tiny', max_batch=4, threads=1, num_cpus=1, "
            "autoscale='1:2', upscale_delay_s=1, downscale_delay_s=3)), name='specdec', route_prefix='/')") % address
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, "SPECDEC_CACHE": str(caches["node_a"].parent / "cache-driver")}, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]

    def wait_for(n: int, seconds: float) -> float:
        t0 = time.monotonic()
        while running_replicas(env, address) != n:
            assert time.monotonic() - t0 < seconds, f"not {n} replicas after {seconds} s"
            time.sleep(1)
        return time.monotonic() - t0

    down_idle = wait_for(1, 90)
    stop = time.monotonic() + 90
    answers: list[tuple[int, str, str]] = []

    def load(k: int):
        for i in range(10_000):  # bounded in count and in time
            if time.monotonic() > stop:
                return
            prompt = PROMPTS[(k + i) % 3]
            answers.append((*ask(url, prompt), prompt))

    with cf.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(load, k) for k in range(12)]
        try:
            up = wait_for(2, 60)
        finally:
            stop = time.monotonic()  # the clients stop: idle from here
            for f in futures:
                f.result(timeout=120)
    down = wait_for(1, 90)
    record_property("autoscaling", {"to_1_idle_s": round(down_idle, 1), "to_2_under_load_s": round(up, 1), "back_to_1_s": round(down, 1)})
    print(f"autoscaling: 1 replica after {down_idle:.0f} s idle, 2 after {up:.0f} s of load, 1 again {down:.0f} s after it")
    assert answers and all(s == 200 for s, _, _ in answers), [a for a in answers if a[0] != 200][:3]
    assert all(json.loads(b)["choices"][0]["token_ids"] == reference(p, 16) for _, b, p in answers)
