"""Export the fused draft graph: γ draft steps, and the choice of each token, in ONE call.

A draft step is a small model run; called one at a time, each step pays ONNX Runtime's fixed
per-call cost and a trip through NumPy to pick its token. This graph unrolls the γ steps and
picks every token inside the graph, for B rows at once (B = 1 for the decoder):

    input_ids [B, 1] (each row's last committed token), position_ids [B, 1], seqlens_k [B]
      │  step j = 0..γ-1: the model on one token per row at position + j, its KV written in place
      │                   (one batch-1 GroupQueryAttention per row and layer, as export/batched.py)
      ▼
    logits_j [B, V] ──► standardize (per row: temperature -> top-k -> top-p, as runtime/sampling.py)
                     ──► q_j [B, V] ──► token: argmax where temperature == 0, else inverse CDF at
                                          uniforms[:, j] (drawn by the runtime from the request's RNG)
                     ──► next step's input
    outputs: tokens int64 [B, γ], probs float32 [B, γ, V] (q: what each token was drawn from),
             present_key_i_b_j / present_value_i_b_j: step j's write, bound to row b's past buffer

A second variant takes no sampling inputs and returns no probs: every row greedy, argmax only
(a call of it skips the softmax the sampling graph computes for its If; 20% of a demo draft call).

The graph is correct only when every present output is bound to its row's past buffer (as
engines/fused.py binds them): that aliasing is how step j + 1 sees step j's KV row. Run with
unbound outputs (a plain ``session.run``), later steps would attend without the earlier ones.

Every token is drawn from exactly the q row the graph returns, so Algorithm 1 on those rows
keeps the target's law whatever rounding the graph's float32 standardization has. The draft
token x_γ is not fed (as in the step-by-step loop); its KV row is written by the next call.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.export import attention
from specdec.export.batched import ATTN_NAME, RowsState
from specdec.manifest import GraphIO, TensorSpec

SAMPLING_INPUTS = (  # (name, dtype) per row, after the ids, positions and seqlens
    ("uniforms", "float32"),  # [B, γ] in [0, 1): one per drafted token
    ("temperature", "float32"),  # [B]; 0: argmax
    ("top_k", "int64"),  # [B]; 0: off
    ("top_p", "float32"),  # [B]; 1: off
)


def _filtered(logits: torch.Tensor, t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [B, V] after temperature, top-k and top-p (one full sort per row)."""
    vocab = logits.shape[-1]
    ranked, order = torch.topk(logits / t[:, None], vocab, dim=-1)  # ONNX TopK: equal scores keep the lower index first
    # top-k: drop scores below the k-th largest (ties with it stay)
    k = torch.where(top_k > 0, torch.clamp(top_k, max=vocab), torch.full_like(top_k, vocab))
    kth = ranked.gather(1, (k - 1)[:, None])  # [B, 1]
    ranked = torch.where(ranked < kth, torch.full_like(ranked, float("-inf")), ranked)
    # top-p: a token is dropped while the mass of it and every less likely token is <= 1 - p;
    # the most likely token stays
    tail = torch.flip(torch.cumsum(torch.flip(torch.softmax(ranked, dim=-1), [-1]), -1), [-1])  # [B, V]: mass of ranks >= i
    drop = (tail <= (1.0 - top_p)[:, None]) & (torch.arange(vocab) > 0)  # (no in-place writes in an If branch)
    ranked = torch.where(drop, torch.full_like(ranked, float("-inf")), ranked)
    return torch.zeros_like(logits).scatter(1, order, torch.softmax(ranked, dim=-1))  # back to token order


def _tempered(logits: torch.Tensor, t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [B, V] after temperature alone (no row filters: no sort)."""
    return torch.softmax(logits / t[:, None], dim=-1)


def standardize(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> probabilities [B, V]: runtime.sampling.standardize per row, in float32
    (rows with temperature 0 are standardized at temperature 1; their token is the argmax).
    The sort runs only in calls where a sampled row filters (an ONNX If)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    filtering = ((temperature > 0) & ((top_k > 0) | (top_p < 1.0))).any()
    return torch.cond(filtering, _filtered, _tempered, (logits, t, top_k, top_p))


def _sampled(probs: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [B]: the first argmax where temperature == 0, else inverse CDF of probs [B, V]
    at u [B] (as runtime.sampling.sample: never a zero-mass token)."""
    vocab = probs.shape[-1]
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]
    idx = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)  # [B]
    index = torch.arange(vocab, device=probs.device)
    last = torch.where(probs > 0, index, torch.zeros_like(index)).amax(-1)  # the last token with mass
    return torch.where(temperature > 0, torch.minimum(idx, last), logits.argmax(-1))


def _greedy(probs: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor):
    """Each row's token [B] and the distribution [B, V] it was drawn from (not read for greedy
    rows: greedy verification compares tokens). A call where every row is greedy draws nothing
    (an ONNX If; torch.cond cannot nest, so its softmax still runs)."""
    probs = standardize(logits, temperature, top_k, top_p)
    return torch.cond((temperature > 0).any(), _sampled, _greedy, (probs, logits, temperature, u)), probs


class _FusedWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, rows: int, gamma: int):
        super().__init__()
        self.model, self.rows, self.gamma = model, rows, gamma

    def forward(self, input_ids, position_ids, seqlens_k, uniforms, temperature, top_k, top_p, past: list[torch.Tensor]):
        return self.steps(input_ids, position_ids, seqlens_k, past, lambda logits, j: choose(logits, temperature, top_k, top_p, uniforms[:, j]))

    def steps(self, input_ids, position_ids, seqlens_k, past: list[torch.Tensor], pick):
        layers = self.model.config.num_hidden_layers
        pk = [[past[2 * (b * layers + i)] for b in range(self.rows)] for i in range(layers)]
        pv = [[past[2 * (b * layers + i) + 1] for b in range(self.rows)] for i in range(layers)]
        ids, tokens, probs, kv = input_ids, [], [], []
        for j in range(self.gamma):
            # Every step reads the graph's own past inputs and writes a present output that the
            # runtime binds to the same buffer: ORT appends step j's row in place, where step
            # j + 1 (which depends on step j's token) reads it. No buffer is ever copied.
            # Step j's totals are computed here, from seqlens_k: CUDA's GroupQueryAttention read
            # such a total wrong (docs/gpu.md), so on CUDA the draft model runs its step graphs.
            state = RowsState(pk, pv, seqlens_k + j, [(seqlens_k[b] + j + 1).to(torch.int32) for b in range(self.rows)])
            with attention.call_state(state):
                out = self.model(input_ids=ids, position_ids=position_ids + j, past_key_values=attention.PassThroughCache(), use_cache=True)
            tok, q = pick(out.logits[:, -1].float(), j)
            tokens.append(tok)
            probs.append(q)
            ids = tok[:, None]
            for b in range(self.rows):
                for i in range(layers):
                    kv += [state.present_k[i][b], state.present_v[i][b]]
        return (torch.stack(tokens, 1), *([torch.stack(probs, 1)] if probs[0] is not None else []), *kv)


class _GreedyWrapper(_FusedWrapper):
    """Every row greedy: argmax only, no sampling inputs and no probabilities out."""

    def forward(self, input_ids, position_ids, seqlens_k, past: list[torch.Tensor]):
        return self.steps(input_ids, position_ids, seqlens_k, past, lambda logits, j: (logits.argmax(-1), None))


def signature(layers: int, rows: int, gamma: int, kv_heads: int, head_dim: int, vocab: int, max_seq: int, dtype: str, greedy: bool = False):
    """Inputs, outputs and I/O roles of a fused draft graph (past listed row-major; present
    step-major, each step's pairs in past's order). ``greedy``: the argmax-only graph."""
    kv = (1, kv_heads, max_seq, head_dim)
    inputs = [TensorSpec("input_ids", "int64", (rows, 1)), TensorSpec("position_ids", "int64", (rows, 1)),
              TensorSpec("seqlens_k", "int32", (rows,))]  # fmt: skip
    sampling = () if greedy else SAMPLING_INPUTS
    inputs += [TensorSpec(name, dt, (rows, gamma) if name == "uniforms" else (rows,)) for name, dt in sampling]
    outputs = [TensorSpec("tokens", "int64", (rows, gamma))]
    if not greedy:
        outputs.append(TensorSpec("probs", "float32", (rows, gamma, vocab)))
    past = [(f"past_key_{i}_{b}", f"past_value_{i}_{b}") for b in range(rows) for i in range(layers)]
    for pk, pv in past:
        inputs += [TensorSpec(pk, dtype, kv), TensorSpec(pv, dtype, kv)]
    # step-major: step j's pairs in past's order; each is bound to its past buffer
    present = [(f"present_key_{i}_{b}_{j}", f"present_value_{i}_{b}_{j}") for j in range(gamma) for b in range(rows) for i in range(layers)]
    for nk, nv in present:
        outputs += [TensorSpec(nk, dtype, kv), TensorSpec(nv, dtype, kv)]
    io = GraphIO("input_ids", "position_ids", None if greedy else "probs", tuple(past), tuple(present), seqlens="seqlens_k",
                 tokens="tokens", **{name: name for name, _ in sampling})  # fmt: skip
    return inputs, outputs, io


def export_fused(model: torch.nn.Module, path: Path, rows: int, gamma: int, max_seq: int, kv_heads: int, head_dim: int, dtype: str,
                 greedy: bool = False):  # fmt: skip
    """Export ``model``'s γ-step fused draft graph for ``rows`` rows to ``path`` (+ external data);
    ``greedy``: the argmax-only variant (a call where every row samples nothing skips softmax)."""
    from specdec.export.graphs import TORCH_DTYPES

    cfg = model.config
    layers = cfg.num_hidden_layers
    inputs, outputs, io = signature(layers, rows, gamma, kv_heads, head_dim, cfg.vocab_size, max_seq, dtype, greedy)
    starts = torch.tensor([2 + 3 * (b % 2) for b in range(rows)])  # trace after 2 and 5 committed rows
    sampling = (torch.full((rows, gamma), 0.5), torch.ones(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows))
    past = [torch.zeros(1, kv_heads, max_seq, head_dim, dtype=TORCH_DTYPES[dtype]) for _ in range(2 * layers * rows)]
    args = (torch.zeros(rows, 1, dtype=torch.long), starts[:, None].clone(), starts.to(torch.int32), *(() if greedy else sampling), past)
    wrapper = (_GreedyWrapper if greedy else _FusedWrapper)(model, rows, gamma).eval()
    attention.export_traced(wrapper, args, path, inputs, outputs, config=cfg, attn=ATTN_NAME)
    return inputs, outputs, io
