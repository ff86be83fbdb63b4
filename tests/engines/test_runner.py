"""GraphRunner on a real exported llama pair: I/O binding writes KV rows in place at the committed
length, dynamic graphs rebind only on a shape change, static ones never, and every mismatch
(graph vs manifest, cache vs graph, tokens vs capacity/max-seq-len) is a one-line specdec error.

The I/O-binding path is compared with a plain ``session.run`` fed numpy copies of the same
inputs (no binding, no shared buffers), so a wrong pointer, shape or scalar shows as a difference.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap

import numpy as np
import onnxruntime as ort
import pytest

pytest.importorskip("torch")  # the llama_bundle fixture exports with torch

from specdec.engines.kv import KVCache  # noqa: E402
from typing import NamedTuple  # noqa: E402

from specdec.engines.executor import Executor  # noqa: E402
from specdec.engines.ort import GraphRunner, runner_for  # noqa: E402
from specdec.engines.sessions import open_session  # noqa: E402
from specdec.engines.threads import ThreadPolicy  # noqa: E402
from specdec.errors import EngineError, InputError, SignatureError  # noqa: E402
from specdec.manifest import load_manifest  # noqa: E402

EXACT = 1e-5  # same graph, same inputs, bound vs fed: float32 noise at most
PROMPT = [5, 17, 42, 9, 100, 7, 250, 3, 61]


@pytest.fixture(scope="module")
def bundle(llama_bundle):
    """(bundle dir, manifest, graph name -> session), one thread per session (a 2-core box)."""
    _, _, out = llama_bundle
    manifest = load_manifest(out)
    sessions = {name: open_session(out, name, g, threads=1) for name, g in manifest.graphs.items() if g.flavour == "ort"}
    return out, manifest, sessions


class Runners(NamedTuple):
    cache: KVCache  # the executor's one slot
    dynamic: GraphRunner
    static: GraphRunner


def fresh(bundle, model: str = "target") -> Runners:
    """A one-slot executor's cache and batch-1 runners (any length, and the fixed-length binding)."""
    out, manifest, sessions = bundle
    ex = Executor(out, manifest, model, sessions, "cpu", slots=1)
    return Runners(ex.slot(0), ex.dynamic, ex.static)


def snapshot(cache: KVCache) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(k.copy(), v.copy()) for k, v in zip(cache.keys, cache.values)]


def plain_run(runner: GraphRunner, tokens, past) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The same call as ``runner.run(tokens)`` through ``session.run`` with numpy inputs:
    (logits [n, V], per layer the full present (key, value) buffers)."""
    io, start, n = runner.spec.io, runner.cache.length, len(tokens)
    feed = {
        io.ids: np.array([tokens], dtype=np.int64),
        io.positions: np.arange(start, start + n, dtype=np.int64)[None],
        io.seqlens: np.array([start + n - 1], dtype=np.int32),
        io.total: np.array(start + n, dtype=np.int32),
    }
    for (k_name, v_name), (k, v) in zip(io.past, past):
        feed[k_name], feed[v_name] = k.copy(), v.copy()
    names = [io.logits, *(name for pair in io.present for name in pair)]
    got = dict(zip(names, runner.session.run(names, feed)))
    return got[io.logits][0], [(got[k], got[v]) for k, v in io.present]


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


def test_model_runners_share_one_cache(bundle):
    _, manifest, _ = bundle
    cache, dynamic, static = fresh(bundle)[:3]
    assert dynamic.cache is cache and static.cache is cache
    assert (dynamic.static, dynamic.capacity) == (False, manifest.max_seq_len)
    assert (static.static, static.capacity, static.bound_tokens) == (True, manifest.k, manifest.k)
    assert len(cache.keys) == manifest.target.num_layers and cache.max_seq == manifest.max_seq_len
    draft = fresh(bundle, "draft")
    assert draft.static.capacity == 1 and len(draft.cache.keys) == manifest.draft.num_layers


def test_verify_writes_rows_in_place_at_committed_length(bundle):
    cache, dynamic, verify = fresh(bundle)[:3]
    k = verify.capacity
    dynamic.run(PROMPT)
    cache.append(len(PROMPT))
    start = cache.length
    verify.run([20, 21, 22, 23, 24])  # a rejected call: its rows are written, never committed
    before = snapshot(cache)
    objects, ptrs = [*cache.keys, *cache.values], cache.pointers()
    tokens = [11, 12, 13, 14, 15]

    out = verify.run(tokens)

    assert cache.length == start  # committing is the caller's job
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, zip(cache.keys, cache.values))):
        for tag, old, new in (("key", k0, k1), ("value", v0, v1)):
            # (a) committed rows and rows past the call are byte-identical
            assert old[:, :, :start].tobytes() == new[:, :, :start].tobytes(), f"layer {layer} {tag}: committed rows changed"
            assert old[:, :, start + k :].tobytes() == new[:, :, start + k :].tobytes(), f"layer {layer} {tag}: rows past the call changed"
            # (b) every row of the call is written: non-zero and not the stale rows of the rejected call
            rows_new, rows_old = new[0, :, start : start + k], old[0, :, start : start + k]  # [kvH, K, D]
            assert np.abs(rows_new).max(axis=(0, 2)).min() > 0, f"layer {layer} {tag}: a row of the call is zero"
            assert (rows_new != rows_old).any(axis=(0, 2)).all(), f"layer {layer} {tag}: a row kept the stale values"
    # (c) no reallocation: same arrays, same addresses
    assert all(a is b for a, b in zip(objects, [*cache.keys, *cache.values]))
    assert cache.pointers() == ptrs
    # (d) the result is a view of the runner's logits buffer, one row per token
    assert out.shape == (k, verify.logits.shape[-1])
    assert np.shares_memory(out, verify.logits)


@pytest.mark.parametrize("role", ["dynamic", "static"])
def test_io_binding_matches_plain_run(bundle, role):
    """Compare paths: the bound, in-place call against session.run on numpy copies."""
    cache, dynamic, static = fresh(bundle)[:3]
    # the prompt call itself, from an empty cache
    ref_logits, ref_present = plain_run(dynamic, PROMPT, snapshot(cache))
    np.testing.assert_allclose(dynamic.run(PROMPT), ref_logits, rtol=0, atol=EXACT)
    for (rk, rv), k, v in zip(ref_present, cache.keys, cache.values):
        np.testing.assert_allclose(k[:, :, : len(PROMPT)], rk[:, :, : len(PROMPT)], rtol=0, atol=EXACT)
        np.testing.assert_allclose(v[:, :, : len(PROMPT)], rv[:, :, : len(PROMPT)], rtol=0, atol=EXACT)
    cache.append(len(PROMPT))

    runner = dynamic if role == "dynamic" else static
    tokens = [30, 31, 32, 33, 34]
    start, past = cache.length, snapshot(cache)
    ref_logits, ref_present = plain_run(runner, tokens, past)
    logits = runner.run(tokens).copy()
    assert np.abs(ref_logits).max() > 1  # a real, peaked output, not zeros on both sides
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=EXACT)
    for layer, ((rk, rv), k, v) in enumerate(zip(ref_present, cache.keys, cache.values)):
        # plain run: present = past with the new rows written at [start, start + K)
        np.testing.assert_array_equal(rk[:, :, :start], past[layer][0][:, :, :start])
        for ref, got in ((rk, k), (rv, v)):
            np.testing.assert_allclose(got[:, :, start : start + 5], ref[:, :, start : start + 5], rtol=0, atol=EXACT)


def test_dynamic_graph_rebinds_only_when_length_changes(bundle):
    cache, dynamic, _ = fresh(bundle)[:3]
    assert (dynamic.rebinds, dynamic.bound_tokens) == (1, 1)  # bound once at construction, for 1 token
    rng = np.random.default_rng(0)
    increments = []
    for n in (3, 3, 1, 1, 1, 2):
        tokens = rng.integers(3, 320, size=n).tolist()
        ref, _ = plain_run(dynamic, tokens, snapshot(cache))
        before = dynamic.rebinds
        got = dynamic.run(tokens)
        increments.append(dynamic.rebinds - before)
        assert dynamic.bound_tokens == n and got.shape[0] == n
        np.testing.assert_allclose(got, ref, rtol=0, atol=EXACT)  # a rebind binds the right memory
        cache.append(n)
    assert increments == [1, 0, 1, 0, 0, 1]


@pytest.mark.parametrize("model", ["target", "draft"])
def test_static_graph_never_rebinds(bundle, model):
    cache, dynamic, static = fresh(bundle, model)[:3]
    assert (static.rebinds, static.bound_tokens) == (1, static.capacity)
    dynamic.run(PROMPT)
    cache.append(len(PROMPT))
    lengths = (5, 1, 3, 5, 2, 4) if static.capacity == 5 else (1, 1, 1)
    for n in lengths:
        tokens = list(range(40, 40 + n))
        static.run(tokens)
        assert static.rebinds == 1 and static.bound_tokens == static.capacity, f"n={n}"
        # n < capacity pads with the last token, at the following positions
        assert static.ids[0, : static.capacity].tolist() == tokens + [tokens[-1]] * (static.capacity - n)
        assert static.pos[0, : static.capacity].tolist() == list(range(cache.length, cache.length + static.capacity))
        cache.append(1)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_padding_leaves_real_tokens_unchanged(bundle, n):
    """A verify call of n < K tokens (padded to K) gives the real tokens' logits and KV rows of
    a dynamic-graph call of exactly those n tokens. Tolerance 1e-4, not bit-equality: the two
    are different graphs run at different S, so ORT's kernels tile and sum in a different order
    (measured up to ~6e-6 here); 1e-4 is the export's float32 bound. Padding leaking into a real token
    (a causal-mask or position bug) moves these peaked logits by O(1)."""
    cache, dynamic, verify = fresh(bundle)[:3]
    dynamic.run(PROMPT)
    cache.append(len(PROMPT))
    start, tokens = cache.length, [70, 71, 72, 73][:n]
    want_logits = dynamic.run(tokens).copy()
    want_rows = [(k[:, :, start : start + n].copy(), v[:, :, start : start + n].copy()) for k, v in zip(cache.keys, cache.values)]
    got = verify.run(tokens)
    assert got.shape[0] == n
    np.testing.assert_allclose(got, want_logits, rtol=0, atol=1e-4)
    for (wk, wv), k, v in zip(want_rows, cache.keys, cache.values):
        np.testing.assert_allclose(k[:, :, start : start + n], wk, rtol=0, atol=1e-4)
        np.testing.assert_allclose(v[:, :, start : start + n], wv, rtol=0, atol=1e-4)


def test_open_session_refuses_another_graph(bundle):
    out, manifest, _ = bundle
    name, spec = manifest.graph("target", "dynamic")
    wrong = dataclasses.replace(spec, file=manifest.graphs["draft_step"].file)  # 1 layer, 1 KV head, S = 1
    with pytest.raises(SignatureError) as e:
        open_session(out, name, wrong, threads=1)
    msg = one_line(e)
    assert name in msg and "draft_step" in msg
    assert re.search(r"lacks inputs \[[^]]*'past_key_1'", msg), msg
    assert "past_key_2" in msg and "present_key_1" in msg
    assert "input input_ids has shape [1, 1], manifest says [1, 'S']" in msg
    assert "past_key_0 has shape [1, 1, 128, 16], manifest says [1, 2, 128, 16]" in msg
    assert "re-export" in msg


def test_open_session_accepts_its_own_graph(bundle):
    """Control for the test above: the same call with the right file is accepted."""
    out, manifest, _ = bundle
    name, spec = manifest.graph("target", "dynamic")
    session = open_session(out, name, spec, threads=1)
    assert {i.name for i in session.get_inputs()} == {t.name for t in spec.inputs}


def test_open_session_refuses_unknown_provider(bundle):
    out, manifest, _ = bundle
    with pytest.raises(EngineError) as e:
        open_session(out, *manifest.graph("target", "dynamic"), provider="tpu")
    assert "tpu" in one_line(e)


def test_open_session_refuses_a_cuda_provider_that_did_not_load(bundle, monkeypatch):
    """onnxruntime-gpu whose CUDA libraries are missing lists the CUDA provider, then falls back to
    the CPU alone with an error in its log (on the H100 image, unless torch was imported first):
    a typed error naming the fix, not a CPU run over a cache that expects the GPU."""
    out, manifest, _ = bundle
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])  # a GPU build here
    with pytest.warns(RuntimeWarning), pytest.raises(EngineError) as e:  # float32 on CUDA warns first
        open_session(out, *manifest.graph("target", "dynamic"), provider="cuda")
    assert "could not start CUDAExecutionProvider" in one_line(e) and "provider='cpu'" in one_line(e)


@pytest.mark.parametrize(
    "layers, dtype, heads, rows, names",
    [(2, "float32", 0, 0, {"3", "2"}), (4, "float32", 0, 0, {"3", "4"}), (3, "float16", 0, 0, {"float16", "float32"}),
     (3, "float32", 1, 0, {"2", "3"}), (3, "float32", 0, -64, {"128", "64"})],
)
def test_runner_refuses_mismatched_cache(bundle, layers, dtype, heads, rows, names):
    """Layers, dtype, KV heads or max-seq-len that differ from the graph's: a one-line SignatureError at
    construction, never ORT's multi-line error at the first call."""
    out, manifest, sessions = bundle
    t = manifest.target
    cache = KVCache(layers, t.num_kv_heads + heads, manifest.max_seq_len + rows, t.head_dim, dtype)
    for role in ("dynamic", "verify"):
        name, spec = manifest.graph("target", role)
        with pytest.raises(SignatureError) as e:
            runner_for(out, name, spec, cache, session=sessions[name])
        msg = one_line(e)
        assert names <= set(re.findall(r"\w+", msg)), msg


@pytest.mark.parametrize("role, n", [("dynamic", 0), ("verify", 0), ("verify", 6), ("dynamic", 129)])
def test_run_refuses_token_counts_outside_capacity(bundle, role, n):
    cache, dynamic, verify = fresh(bundle)[:3]
    runner = dynamic if role == "dynamic" else verify
    before = snapshot(cache)
    with pytest.raises(InputError) as e:
        runner.run(list(range(3, 3 + n)) if n else [])
    assert {str(n), str(runner.capacity)} <= set(re.findall(r"\d+", one_line(e)))
    assert cache.length == 0
    assert all((k0 == k).all() and (v0 == v).all() for (k0, v0), k, v in zip(before, cache.keys, cache.values))


def test_run_refuses_rows_past_max_seq(bundle):
    cache, dynamic, verify = fresh(bundle)[:3]
    cache.append(cache.max_seq - 2)  # 126 committed rows (contents irrelevant here)
    dynamic.run([5, 6])  # rows 126..128: exactly fits
    for runner, tokens in ((dynamic, [5, 6, 7]), (verify, [5])):  # verify pads to K = 5 rows
        with pytest.raises(InputError) as e:
            runner.run(tokens)
        nums = set(re.findall(r"\d+", one_line(e)))
        assert {"126", "128"} <= nums, e.value
    assert cache.length == cache.max_seq - 2


# ThreadPolicy ------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [0, -1, True, False, 1.5, "2"])
def test_thread_policy_refuses_bad_counts(threads):
    with pytest.raises(InputError) as e:
        ThreadPolicy(threads=threads)
    assert repr(threads) in one_line(e)
    with pytest.raises(InputError):
        ThreadPolicy.shared(threads)


def test_thread_policy_constructors_and_labels(monkeypatch):
    monkeypatch.delenv("SPECDEC_THREADS", raising=False)  # the suite's workers set it (tests/conftest.py)
    monkeypatch.delenv("SPECDEC_SPIN", raising=False)
    assert ThreadPolicy.of(3) == ThreadPolicy.per_session(3) == ThreadPolicy(3, False)
    assert ThreadPolicy.of(None) == ThreadPolicy.per_session() == ThreadPolicy()
    policy = ThreadPolicy.shared(2)
    assert ThreadPolicy.of(policy) is policy and policy.shared_pool
    assert ThreadPolicy.per_session(2).label == "per-session x2"
    assert ThreadPolicy.per_session().label == "per-session x(cores)"
    assert ThreadPolicy.shared(4).label == "shared x4"
    assert ThreadPolicy.shared().label == "shared x(cores)"
    quiet = ThreadPolicy.per_session(2, spin=False)
    assert quiet != ThreadPolicy.per_session(2) and not quiet.spin and not quiet.shared_pool
    assert quiet.label == "per-session, no spin x2"


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_threads_from_the_environment(monkeypatch, value):
    """$SPECDEC_THREADS sizes every policy that names no count; a bad value is refused by name."""
    monkeypatch.setenv("SPECDEC_THREADS", "3")
    assert ThreadPolicy().threads == ThreadPolicy.shared().threads == 3 and ThreadPolicy(2).threads == 2
    assert ThreadPolicy.per_session().session_options().intra_op_num_threads == 3
    monkeypatch.setenv("SPECDEC_THREADS", value)
    with pytest.raises(InputError) as e:
        ThreadPolicy()
    assert f"SPECDEC_THREADS={value!r}" in one_line(e)


@pytest.mark.parametrize("value", ["no", "2", "true"])
def test_spin_from_the_environment(monkeypatch, value):
    """$SPECDEC_SPIN=0 makes every per-session pool that names no choice sleep between ops (a
    busy, shared box); an explicit spin= wins; a bad value is refused by name."""
    monkeypatch.setenv("SPECDEC_SPIN", "0")
    assert not ThreadPolicy().spin and not ThreadPolicy.of(2).spin and ThreadPolicy.per_session(2, spin=True).spin
    assert ThreadPolicy.per_session(2).session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    monkeypatch.setenv("SPECDEC_SPIN", "1")
    assert ThreadPolicy().spin and ThreadPolicy.of(2) == ThreadPolicy.per_session(2, spin=True)
    monkeypatch.setenv("SPECDEC_SPIN", value)
    with pytest.raises(InputError) as e:
        ThreadPolicy()
    assert f"SPECDEC_SPIN={value!r}" in one_line(e)


def test_per_session_options(monkeypatch):
    monkeypatch.delenv("SPECDEC_THREADS", raising=False)
    monkeypatch.delenv("SPECDEC_SPIN", raising=False)
    so = ThreadPolicy.per_session(3).session_options()
    assert so.intra_op_num_threads == 3 and so.use_per_session_threads
    assert so.get_session_config_entry("session.force_spinning_stop") == "1"
    assert ThreadPolicy.per_session().session_options().intra_op_num_threads == 0  # ORT's default: one per core
    quiet = ThreadPolicy.per_session(2, spin=False).session_options()
    assert quiet.intra_op_num_threads == 2
    assert quiet.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(RuntimeError, match="force_spinning_stop"):  # ORT: no such entry was set
        quiet.get_session_config_entry("session.force_spinning_stop")


def test_shared_pool_in_a_subprocess(bundle):
    """The shared pool is process-wide, so it is made in a child process: sessions run on it,
    a second size and a per-session pool are then refused with EngineError."""
    out, _, _ = bundle
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from specdec.engines.executor import Executor
        from specdec.engines.sessions import open_session
        from specdec.engines.threads import ThreadPolicy
        from specdec.errors import EngineError
        from specdec.manifest import load_manifest

        bundle = Path({str(out)!r})
        m = load_manifest(bundle)
        pool = ThreadPolicy.shared(1)
        sessions = {{n: open_session(bundle, n, g, threads=pool) for n, g in m.graphs.items()}}
        dynamic = Executor(bundle, m, "target", sessions).dynamic
        logits = dynamic.run([5, 6, 7])
        assert logits.shape == (3, m.vocab_size) and abs(logits).max() > 0
        assert not pool.session_options().use_per_session_threads
        for bad in (ThreadPolicy.shared(2), ThreadPolicy.per_session(1)):
            try:
                bad.session_options()
            except EngineError as e:
                assert "\\n" not in str(e)
                print("refused", bad.label)
            else:
                raise SystemExit("not refused: " + bad.label)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["refused shared x2", "refused per-session x1"]
