"""The tree verify graph (export/tree.py): every node's logits and K/V are PyTorch's on the
node's own root-to-node path, after the CPU optimizations, with siblings at one position."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from models import config_for, peaked_model  # noqa: E402

MAX_SEQ = 64
PARENTS = [-1, 0, 0, 1, -1, 4, 3]  # two branches under the root; 1 and 2 are siblings; depth up to 3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_verify_graph_matches_pytorch_per_path(family, tmp_path):
    import onnx
    import onnxruntime as ort
    from transformers import DynamicCache

    from specdec.export.families import family_of
    from specdec.export.optimize import optimize_for_cpu
    from specdec.engines.ort import tree_bias
    from specdec.export.tree import export_tree_verify

    model = peaked_model(config_for(family), seed=5).eval()
    cfg = model.config
    fam = family_of(cfg, family)
    kvh, d, layers = fam.kv_heads(cfg), fam.head_dim(cfg), cfg.num_hidden_layers
    path = tmp_path / "tree.onnx"
    n = len(PARENTS)
    export_tree_verify(model, path, n, MAX_SEQ, kvh, d, "float32")
    optimize_for_cpu(path, MAX_SEQ)
    gqa = [node for node in onnx.load(str(path), load_external_data=False).graph.node if node.op_type == "GroupQueryAttention"]
    assert len(gqa) == layers and all(len(node.input) == 11 for node in gqa)  # the bias in, rotary by position outside

    rng = np.random.default_rng(0)
    context = rng.integers(3, cfg.vocab_size, size=9).tolist()
    tokens = rng.integers(3, cfg.vocab_size, size=n).tolist()
    tokens[2] = tokens[1]  # a sibling repeating a token: same position, same token, its own row
    depth = []
    for p in PARENTS:
        depth.append(0 if p < 0 else depth[p] + 1)
    past = len(context)
    with torch.no_grad():
        cache = DynamicCache()
        model(torch.tensor([context]), past_key_values=cache, use_cache=True)
    feeds = {"input_ids": np.array([tokens]), "position_ids": np.array([[past + k for k in depth]]),
             "seqlens_k": np.array([past + n - 1], np.int32), "total_sequence_length": np.array(past + n, np.int32),
             "tree_bias": tree_bias(PARENTS)}  # fmt: skip
    for i in range(layers):
        for name, t in (("key", cache.layers[i].keys), ("value", cache.layers[i].values)):
            buf = np.zeros((1, kvh, MAX_SEQ, d), np.float32)
            buf[:, :, :past] = t.numpy()
            feeds[f"past_{name}_{i}"] = buf
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = ["logits"] + [f"present_key_{i}" for i in range(layers)]
    logits, *keys = sess.run(names, feeds)

    for i in range(n):
        chain, j = [], i
        while j >= 0:
            chain.insert(0, tokens[j])
            j = PARENTS[j]
        with torch.no_grad():
            ref_cache = DynamicCache()
            ref = model(torch.tensor([context + chain]), past_key_values=ref_cache, use_cache=True).logits[0, -1].numpy()
        scale = max(1.0, float(np.abs(ref).max()))
        assert np.abs(logits[0, i] - ref).max() < 1e-4 * scale, (family, i, np.abs(logits[0, i] - ref).max())
        for layer in range(layers):  # node i's K row sits at past + i, rotated at its own position
            want = ref_cache.layers[layer].keys[0, :, -1].numpy()  # [kvH, D]
            assert np.abs(keys[layer][0, :, past + i] - want).max() < 1e-4 * max(1.0, float(np.abs(want).max())), (family, i, layer)


def test_bundle_with_a_tree_graph(tmp_path):
    """--tree-nodes adds the target's tree graph to the bundle, validated per root-to-node path
    (logits and the kept rows' K/V); its runner builds the ancestors' bias and refuses a tree
    out of topological order; the bundle's other graphs decode as before."""
    from models import save_pair

    from specdec.engines.kv import KVCache
    from specdec.engines.ort import TreeRunner
    from specdec.engines.sessions import open_session
    from specdec.errors import InputError
    from specdec.export.pipeline import ExportConfig, export_bundle
    from specdec.runtime.decoder import SpeculativeDecoder

    target, draft = save_pair(tmp_path, "llama", near=0.1)
    out = tmp_path / "bundle"
    m = export_bundle(ExportConfig(str(target), str(draft), out, gamma=3, max_seq_len=64, tree_nodes=6))
    g = m.graphs["target_tree"]
    assert (g.role, g.tokens, g.io.tree_bias) == ("tree", 6, "tree_bias")
    v = m.validation["target_tree"]
    assert v["top1_agreement"] == 1.0 and v["positions"] >= 8 and v["logits"] < 1e-4 * max(1.0, v["logits_scale"])
    assert v["present_key"] < 1e-4 * max(1.0, v["kv_scale"])

    t = m.target
    cache = KVCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype)
    runner = TreeRunner(open_session(out, "target_tree", g), "target_tree", g, cache)
    cache.append(4)
    logits = runner.run_tree([5, 6, 7, 8], [-1, 0, 0, 2])  # 2 padding nodes after these 4
    assert logits.shape == (4, m.vocab_size)
    visible = runner.bias[0, 0] == 0
    assert visible[3].tolist() == [True, False, True, True, False, False]  # node 3: root child 0, its parent 2, itself
    assert visible[4].tolist() == [False] * 4 + [True, False]  # padding: itself only
    assert runner.pos[0].tolist() == [4, 5, 5, 6, 4, 4]
    with pytest.raises(InputError, match=r"parents\[1\] = 1"):
        runner.run_tree([5, 6], [-1, 1])
    assert SpeculativeDecoder.load(out).generate([5, 9, 2, 7], max_new_tokens=12, gamma=3, ignore_eos=True).stats.verify_calls > 0


@pytest.mark.parametrize("value", ["1", "65", "x"])
def test_tree_nodes_must_be_a_small_count(llama_bundle, tmp_path, value):
    from test_bad_input import assert_one_line_error, export_cli

    target, draft, _ = llama_bundle
    res = export_cli("--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "b"), "--tree-nodes", value)
    if value == "x":
        assert res.returncode == 2 and "--tree-nodes" in res.stderr
    else:
        assert_one_line_error(res, f"--tree-nodes {value}", "expected an integer in 2..64")
    assert not (tmp_path / "b").exists()


def test_tree_nodes_refuse_a_sliding_window_model(tmp_path):
    """In process: the command line's one-line error (exit 2) is the same path for every refusal
    (tests/export/test_bad_input.py)."""
    from models import save_pair

    from specdec.errors import ConfigError
    from specdec.export.pipeline import ExportConfig, export_bundle

    target, draft = save_pair(tmp_path, "mistral")  # window 16
    with pytest.raises(ConfigError) as err:
        export_bundle(ExportConfig(str(target), str(draft), tmp_path / "b", tree_nodes=8))
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in ("--tree-nodes 8", "sliding_window=16", "export without --tree-nodes")), msg
    assert not (tmp_path / "b").exists()
