"""Tiny real Hugging Face models for tests, built from configs (no hub access here).

Default initialisation gives nearly uniform next-token distributions, which hide exactness
bugs (every token is about as likely, so a wrong row still "looks" right). We make them
peaked without making them ill-conditioned: weight matrices x4, and the final norm x8, which
scales the logits exactly. (Scaling every matrix x40 also peaks them, but then attention
scores grow ~1600x and PyTorch's own float32 forward drifts 1e-4..5e-4 from float64, below
which no export can be checked; with this recipe that drift is ~1e-5.)
"""

from __future__ import annotations

import re
from pathlib import Path

VOCAB = 320
CORPUS = """def add(a, b):\n    return a + b\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n
    def push(self, x):\n        self.items.append(x)\n\nfor i in range(10):\n    print(i, i * i)\n
import os\nimport sys\nwith open(path) as f:\n    data = f.read()\nif __name__ == "__main__":\n    main()\n""" * 4


# A chat template in the usual shape (role headers, special tokens written by the template itself).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


def make_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with VOCAB ids, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CORPUS], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(folder)


MODEL_TYPES = {"gemma3": "gemma3_text"}  # test family name -> transformers model_type where they differ


def config_for(family: str, size: str = "target"):
    """A tiny config of ``family``; the draft is smaller than the target."""
    from transformers import AutoConfig

    big = size == "target"
    hidden, layers, heads = (64, 3, 4) if big else (32, 1, 2)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    kw = {
        "llama": dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=512),
        "qwen2": dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=512),
        # Mistral: a sliding window far below the tests' lengths, so every layer's window is crossed
        "mistral": dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=512,
                        sliding_window=16),
        # Qwen3: per-head q/k RMSNorm before rotary; head_dim given apart from hidden / heads
        "qwen3": dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads // 2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False),
        # Phi-3: fused qkv_proj and gate_up_proj, plain rotary (no LongRoPE scaling)
        "phi3": dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=heads // 2, max_position_embeddings=512, original_max_position_embeddings=512,
                     rope_scaling=None, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
        # Gemma 3 text: local layers (window 12, RoPE base 1e4) before a global one (base 1e6), q/k
        # norms, query_pre_attn_scalar apart from head_dim, embedding x sqrt(hidden), tied head
        "gemma3": dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads // 2, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                       layer_types=(["sliding_attention"] * (layers - 1) + ["full_attention"]) if big else ["sliding_attention"],
                       rope_theta=1e6, rope_local_base_freq=1e4, max_position_embeddings=512),
        # Gemma 2: alternating local (window 12) and global layers, score and final-logit soft-capping
        "gemma2": dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads // 2, head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                       layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
                       attn_logit_softcapping=3.0, final_logit_softcapping=30.0, max_position_embeddings=512),
        "gpt2": dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=512),
        "opt": dict(hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    max_position_embeddings=512, word_embed_proj_dim=hidden),
        "gpt_neox": dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, max_position_embeddings=512, rotary_pct=0.5),
    }[family]
    return AutoConfig.for_model(MODEL_TYPES.get(family, family), **common, **kw)


def peaked_model(cfg, seed: int, inner: float = 4.0, head: float = 8.0):
    """A model from ``cfg`` with peaked next-token distributions (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    final = [m for name, m in model.named_modules() if re.search(r"(norm|ln_f)$", name) and not re.search(r"\.\d+\.", name)]
    return sharpen(model, inner, final, head)  # the final norm only


def sharpen(model, inner: float, norms: list, head: float):
    """Scale every weight matrix by ``inner`` and the ``norms`` (weight and bias) by ``head``:
    the last norm's scale multiplies the logits exactly."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(inner)
        for norm in norms:
            if type(norm).__name__.startswith("Gemma"):  # Gemma norms scale by (1 + weight)
                norm.weight.add_(1).mul_(head).sub_(1)
                continue
            norm.weight.mul_(head)
            if getattr(norm, "bias", None) is not None:
                norm.bias.mul_(head)
    return model


def top1_mass(model, seed: int = 0) -> float:
    """Mean top-1 probability over random contexts: a check that the model is peaked."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (4, 32), generator=g)
    with torch.no_grad():
        probs = model(ids).logits.softmax(-1)
    return float(probs.max(-1).values.mean())


def near_copy(model, noise: float, seed: int):
    """A draft that agrees with ``model`` often but not always: its weights plus Gaussian noise
    of ``noise`` x each matrix's std (0.1 gives argmax agreement ~0.5-0.7 on random contexts),
    so decoding crosses both rejections and fully accepted calls."""
    import copy

    import torch

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    return draft


def save_pair(root: Path, family: str, seed: int = 0, near: float | None = None) -> tuple[Path, Path]:
    """Write target and draft checkpoints (safetensors + tokenizer) of ``family`` under ``root``.

    The draft is a smaller random model, or with ``near`` a noisy copy of the target.
    """
    target = peaked_model(config_for(family, "target"), seed)
    draft = peaked_model(config_for(family, "draft"), seed + 1) if near is None else near_copy(target, near, seed + 1)
    out = []
    for size, model in (("target", target), ("draft", draft)):
        folder = root / f"{family}-{size}"
        assert top1_mass(model) > 0.35, f"{family} {size} is not peaked: top-1 mass {top1_mass(model):.2f}"
        model.save_pretrained(folder, safe_serialization=True)
        make_tokenizer(folder)
        out.append(folder)
    return out[0], out[1]


# -- encoder-decoder (T5, BART, Marian) ---------------------------------------------------------

SEQ2SEQ_FAMILIES = ["t5", "bart", "marian"]
# (matrix scale, head scale) per family for a top-1 mass of ~0.6-0.8: peaked, with bins left for
# chi-square. T5's attention is unscaled (no 1/sqrt(d)): its own init is peaked enough, and its
# matrices x4 make PyTorch's own float32 forward drift 2e-3 from float64 (nothing can be checked
# to 1e-4 then) and its argmax chaotic under the draft's noise.
SEQ2SEQ_SCALES = {"t5": (1.0, 1.0), "mt5": (1.0, 1.0), "umt5": (1.0, 1.0), "bart": (4.0, 8.0), "marian": (4.0, 8.0), "mbart": (4.0, 8.0),
                  "pegasus": (4.0, 8.0)}  # fmt: skip
# The near draft's noise per family: argmax agreement ~0.65-0.95 along the target's greedy path.
SEQ2SEQ_NEAR = {"t5": 0.05, "mt5": 0.05, "umt5": 0.05, "bart": 0.1, "marian": 0.1, "mbart": 0.1, "pegasus": 0.1}


def seq2seq_config(family: str, size: str = "target", **extra):
    """A tiny encoder-decoder config of ``family`` (head_dim 16: ORT's attention kernel needs a
    multiple of 8); decoding starts at the pad id, as T5 and Marian do. The head is untied: a
    random model whose head is its embedding mostly repeats its last input token, which would
    make greedy outputs one token long and prove little (the tied T5 head, scaled by
    d_model^-0.5, is checked by tests/export/test_seq2seq_export.py)."""
    from transformers import AutoConfig

    big = size == "target"
    d, heads, layers = (64, 4, 2) if big else (32, 2, 1)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2, decoder_start_token_id=2, tie_word_embeddings=False)
    bart = dict(d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                encoder_ffn_dim=2 * d, decoder_ffn_dim=2 * d, max_position_embeddings=256, dropout=0.0, forced_eos_token_id=None)
    t5 = dict(d_model=d, d_kv=16, num_heads=heads, d_ff=2 * d, num_layers=layers, num_decoder_layers=layers,
              feed_forward_proj="relu", dropout_rate=0.0, relative_attention_max_distance=64)
    kw = {
        "t5": t5,
        "mt5": {**t5, "feed_forward_proj": "gated-gelu"},  # mT5 and Flan-T5: T5 v1.1's gated-GELU blocks
        "umt5": {**t5, "feed_forward_proj": "gated-gelu"},  # and a relative bias table per layer
        "bart": bart,
        "marian": {**bart, "scale_embedding": True},
        "mbart": {**bart, "scale_embedding": True},  # pre-LayerNorm blocks, a LayerNorm after each stack
        "pegasus": {**bart, "scale_embedding": True},  # the same, with sinusoidal positions
    }[family]
    return AutoConfig.for_model(family, **{**common, **kw, **extra})


def peaked_seq2seq(cfg, seed: int):
    """An encoder-decoder from ``cfg`` made peaked as ``peaked_model``: matrices and the decoder's
    last norm (T5's final norm; BART's and Marian's last layer's output norm) scaled by the
    family's ``SEQ2SEQ_SCALES``."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    from specdec.export.seq2seq import t5_scales_head

    torch.manual_seed(seed)
    model = AutoModelForSeq2SeqLM.from_config(cfg, dtype=torch.float32).eval()
    inner, head = SEQ2SEQ_SCALES[cfg.model_type]
    t5 = cfg.model_type in ("t5", "mt5", "umt5")
    if t5 and t5_scales_head(cfg):
        head *= cfg.d_model**0.5  # a tied T5 head scales its input by d_model^-0.5: undo it
    elif t5 and model.lm_head.weight is model.shared.weight:
        # transformers 5.x ties every T5 at init; v1.1's head is its own (drawn as 4.57 draws it)
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * cfg.initializer_factor)
    dec = model.get_decoder()
    # the decoder's last norm: T5's final one, mBART's and Pegasus's after the stack, BART's and Marian's last layer's
    last = dec.final_layer_norm if hasattr(dec, "final_layer_norm") else getattr(dec, "layer_norm", None) or dec.layers[-1].final_layer_norm
    return sharpen(model, inner, [last], head)


def seq2seq_top1_mass(model, seed: int = 0) -> float:
    import torch

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, model.config.vocab_size, (4, 16), generator=g)
    tgt = torch.randint(3, model.config.vocab_size, (4, 16), generator=g)
    with torch.no_grad():
        probs = model(input_ids=src, decoder_input_ids=tgt).logits.softmax(-1)
    return float(probs.max(-1).values.mean())


def save_seq2seq_pair(root: Path, family: str, seed: int = 0, near: bool = True, tied: bool = False, **target_config) -> tuple[Path, Path]:
    """Target and draft checkpoints of an encoder-decoder ``family`` under ``root``: the draft is
    a noisy copy (its own encoder too; ``SEQ2SEQ_NEAR``), or without ``near`` a smaller random
    model. ``tied``: the head is the embedding (T5 then scales its input by d_model^-0.5).
    ``target_config``: more options of the target's config (e.g. T5's feed_forward_proj)."""
    cfgs = [seq2seq_config(family, "target", tie_word_embeddings=tied, **target_config), seq2seq_config(family, "draft", tie_word_embeddings=tied)]
    target = peaked_seq2seq(cfgs[0], seed)
    draft = near_copy(target, SEQ2SEQ_NEAR[family], seed + 1) if near else peaked_seq2seq(cfgs[1], seed + 1)
    out = []
    for size, model in (("target", target), ("draft", draft)):
        if not tied:
            _own_embeddings(model)
        folder = root / f"{family}-{size}"
        assert seq2seq_top1_mass(model) > 0.35, f"{family} {size} is not peaked: top-1 mass {seq2seq_top1_mass(model):.2f}"
        model.save_pretrained(folder, safe_serialization=True)
        make_tokenizer(folder)
        out.append(folder)
    return out[0], out[1]


def _own_embeddings(model) -> None:
    """BART's encoder and decoder embeddings share one Parameter with ``shared``: save_pretrained
    keeps one copy, and an untied config then reloads the others at random. Give each its own."""
    import copy

    for part in (model.get_encoder(), model.get_decoder()):
        part.embed_tokens = copy.deepcopy(part.embed_tokens)


def load_seq2seq(src):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(src).eval()


def seq2seq_greedy(model, source: list[int], n: int) -> list[int]:
    """The target's own greedy decode: encoder once, then a plain argmax loop over HF's cache."""
    import torch

    with torch.no_grad():
        enc = model.get_encoder()(input_ids=torch.tensor([source]))
        tok, past, out = model.config.decoder_start_token_id, None, []
        for _ in range(n):
            o = model(encoder_outputs=enc, decoder_input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, tok = o.past_key_values, int(o.logits[0, -1].argmax())
            out.append(tok)
    return out


def train_tiny_head(bundle: Path, root: Path, save: Path | None = None, draft_vocab: int | None = None) -> dict:
    """Train a feature head (``specdec train-drafter``) into ``bundle`` on a few copies of CORPUS:
    400 short steps, enough for a tiny random target's head to be accepted often on corpus text.
    ``draft_vocab``: it drafts over that many of the VOCAB tokens only, as the shipped heads do
    (8192 of 49152), and the runtime draws over those alone (sampling.draw_within)."""
    from specdec.export.train_head import Recipe, train

    corpus = root / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(4):
        (corpus / f"part{i}.py").write_text(CORPUS[i * 50 :] + CORPUS[: i * 50])
    return train(bundle, str(corpus), Recipe(steps=400, batch=8, window=48, windows=96, lr=3e-3, noise=0.0, draft_vocab=draft_vocab), save=save, report=lambda s: None)


def rope_theta(cfg) -> float:
    """The rotary base: ``rope_theta`` (transformers 4.57) or ``rope_parameters["rope_theta"]``
    (5.x; per layer type for Gemma 3, whose global layers' base is the model's)."""
    theta = getattr(cfg, "rope_theta", None)
    if theta is not None:
        return theta
    params = cfg.rope_parameters
    return params["full_attention"]["rope_theta"] if "full_attention" in params else params["rope_theta"]


def set_rope(cfg, theta: float | None = None, **scaling) -> None:
    """Set the rotary base and/or a scaling (``type`` and its fields) the way the installed
    transformers reads them: ``rope_theta``/``rope_scaling`` (4.57) or ``rope_parameters`` (5.x)."""
    theta = rope_theta(cfg) if theta is None else theta
    if getattr(cfg, "rope_parameters", None) is not None:  # 5.x
        params = {"rope_theta": theta, "rope_type": scaling.pop("type", cfg.rope_parameters.get("rope_type", "default")), **scaling}
        if getattr(cfg, "original_max_position_embeddings", None):
            params.setdefault("original_max_position_embeddings", cfg.original_max_position_embeddings)
        if getattr(cfg, "partial_rotary_factor", None) is not None:
            params.setdefault("partial_rotary_factor", cfg.partial_rotary_factor)
        cfg.rope_parameters = params
    else:
        cfg.rope_theta = theta
        if scaling:
            cfg.rope_scaling = scaling


# -- quantized bundles' greedy output (docs/exactness.md, "int8/int4 bundles: why the kernel matters") ---------


def assert_same_up_to_a_close_call(runner, prompt: list[int], got: list[int], want: list[int], label="") -> None:
    """``got`` equals ``want`` (both greedy continuations of ``prompt`` by one int8/int4 bundle)
    up to a first difference, which may only fall at a close call: an int8 activation rounding
    that a verify call and a 1-token call cross differently moves the logits by ~1% of their
    scale; a wrong graph differs at clear calls. ``runner``: the bundle's ``TargetRunner``
    (specdec.commands.bench.quality), whose logits judge the call: its top two within 5% of the scale."""
    import numpy as np

    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        assert len(got) == len(want), (label, len(got), len(want))
        return
    logits = runner.logits(list(prompt) + list(want[:i]))[-1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < 0.05 * np.abs(logits).max(), (label, i, top2)


def measured_default(entry: dict, suggested: str) -> bool:
    """Whether a manifest's default drafter ``entry`` was measured at export (export/recommend.py):
    the folder's ``suggested`` mode among those timed against autoregressive decoding, the
    fastest of them the default, and "why" saying so."""
    from specdec.export.recommend import label

    speeds = entry["measured"]["tokens_per_s"]
    modes = {k: v for k, v in speeds.items() if k != "autoregressive"}
    best = max(modes, key=modes.get)
    return suggested in modes and "autoregressive" in speeds and best == label(entry) and entry["why"].startswith("measured at export")
