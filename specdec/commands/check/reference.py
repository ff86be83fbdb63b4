"""``specdec check --reference``: the bundle's target against the model it was exported from, on
this box (PyTorch: the ``export`` extra).

- logits: the bundle's target graph and the reference over each prompt, max|Δ| over the logits'
  scale and the mean KL(reference || bundle), as export validation reports them;
- greedy: the bundle's autoregressive output against the reference's argmax loop; a first
  difference passes only at a close call of the reference (the near-tie rule of export
  validation for float bundles; 5% of the scale for int8/int4, whose activations are quantized).
"""

from __future__ import annotations

import numpy as np

from specdec.commands.check.exactness import CLOSE_QUANTIZED, SECTION, first_difference
from specdec.commands.check.items import Item
from specdec.errors import ConfigError

NEAR_TIE = 1e-3  # export/agreement.py's: a top-2 gap below this x max(1, max|logit|)


def load(reference: str):
    try:
        import torch  # noqa: F401

        from specdec.export.source import load_model, resolve
    except ImportError:
        raise ConfigError(f"--reference {reference}: needs PyTorch and transformers (pip install torch==2.13.0 -e \".[export]\")") from None
    return load_model(resolve(reference, None))


def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """The reference's argmax loop, with its logits at each step (the whole sequence each step:
    no cache argument, whose name differs between transformers majors)."""
    import torch

    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            row = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].double().numpy()
            logits.append(row)
            seq.append(int(row.argmax()))
    return seq[len(prompt):], logits


def check(m, loaded, reference: str, prompts: list[list[int]], tokens: int) -> list[Item]:
    import torch

    from specdec.runtime.sampling import log_softmax

    if m.seq2seq:
        return [Item(SECTION, "reference", None, "--reference is not run for encoder-decoder bundles yet (export validation compares them)")]
    model = load(reference)
    if model.config.vocab_size < m.vocab_size:
        return [Item(SECTION, "reference", False, f"{reference} has {model.config.vocab_size} tokens, the bundle {m.vocab_size}",
                     "pass the checkpoint this bundle was exported from")]  # fmt: skip
    runner = loaded.runner
    delta = scale = kl = 0.0
    positions = 0
    for p in prompts:
        ours = runner.logits(p).astype(np.float64)  # [n, V]
        with torch.no_grad():
            theirs = model(input_ids=torch.tensor([p])).logits[0, :, : m.vocab_size].double().numpy()  # [n, V]
        delta, scale = max(delta, float(np.abs(ours - theirs).max())), max(scale, float(np.abs(theirs).max()))
        lt, lo = log_softmax(theirs), log_softmax(ours)
        kl += float((np.exp(lt) * (lt - lo)).sum())
        positions += len(p)
    kl /= positions
    wrong, close = [], 0
    for p in prompts:
        got = loaded.base.generate(p, max_new_tokens=tokens, gamma=0, ignore_eos=True).tokens
        want, logits = reference_greedy(model, p, tokens)
        i = first_difference(got, want)
        if i is None:
            continue
        row = logits[i]
        top2 = np.sort(row)[-2:]
        bound = (CLOSE_QUANTIZED if m.quantization else NEAR_TIE) * max(1.0, float(np.abs(row).max()))
        if top2[1] - top2[0] < bound:
            close += 1
        else:
            wrong.append(f"token {i} (bundle {got[i]}, reference {want[i]}; reference's top-2 gap {top2[1] - top2[0]:.3g}, close below {bound:.3g})")
    logit_line = f"logits over {positions} prompt positions: max|Δ| {delta:.3g} of a {scale:.3g} scale, mean KL {kl:.3g}"
    items = [Item(SECTION, "reference logits", None, logit_line)]
    if wrong:
        items.append(Item(SECTION, "reference greedy", False, f"{len(wrong)} of {len(prompts)} requests leave the reference's argmax at a clear call; first at {wrong[0]}",
                          f"the bundle is not {reference}'s model: re-export it from that checkpoint"))  # fmt: skip
    else:
        items.append(Item(SECTION, "reference greedy", True, f"{len(prompts) - close} of {len(prompts)} requests x {tokens} tokens equal the reference's argmax loop"
                                                               + (f"; {close} ended at a close call" if close else "")))  # fmt: skip
    return items
