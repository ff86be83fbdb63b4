"""``specdec bench-peers``: decoding speed of what a user would otherwise reach for, on one pair.

For ONE target (a Hugging Face checkpoint folder, or a GGUF file dequantized once to one under
``--work``, as specdec-export reads it) and optionally a draft checkpoint, in one interleaved run,
modes of each peer (``--modes`` keeps a subset; the draft-model modes need ``--draft``):

* ``specdec``  (``--bundle``, exported from the pair) autoregressive, ``default`` (the bundle's
  default drafter at its γ: what ``SpeculativeDecoder.load(bundle)`` decodes with), the draft
  model at γ = K, adaptive γ, prompt lookup, n-gram table, hierarchical.
* ``hf``       transformers ``generate``, PyTorch CPU, fp32: the target alone; assisted generation
  (``assistant_model=draft``; with sampling, speculative sampling).
* ``optimum``  optimum-onnx ``ORTModelForCausalLM`` (CPU EP, ``export=True`` once): the target alone
  (a private venv: optimum-onnx 0.1 pins transformers below 4.58, which specdec's extras do not).
* ``genai``    onnxruntime-genai (fp32 graphs by its model builder): the target alone; draft-model
  speculation (a composite ``genai_config.json``: ``model.type = "speculative"``, a ``model.draft``
  decoder, ``max_draft_tokens`` = K); n-gram decoding (``ngram_size`` = N).
* ``openvino`` OpenVINO GenAI ``LLMPipeline``, CPU (fp32 IR by optimum-intel, tokenizer by
  openvino-tokenizers; ``INFERENCE_PRECISION_HINT = f32``, else a CPU with AMX computes in bf16): the target alone; ``draft_model=`` (``num_assistant_tokens`` = K);
  ``prompt_lookup=True`` (``max_ngram_size`` = N); ``-int8``/``-int4``: the target exported with
  optimum-intel's ``--weight-format int8/int4`` defaults, autoregressive.
* ``llamacpp`` llama-cpp-python (built from source for this CPU; the target converted by llama.cpp's
  ``convert_hf_to_gguf.py``): the target alone and with the binding's prompt lookup
  (``LlamaPromptLookupDecoding(num_pred_tokens=K)``), at F32, Q8_0, Q4_0 and Q4_1 (``llama_model_quantize``;
  ``-q8_0``/``-q4_0``/``-q4_1`` speedups are over that width's autoregressive run). No draft-model drafter
  in the binding: listed as unavailable. Each file is first probed with a batched eval in a child
  process: where that crashes (0.3.36's quantized kernels on an AMX CPU), its lookup mode is
  unavailable and its autoregressive mode evaluates the prompt a token a call. OpenMP's wait
  policy is left unset, as a user's llama.cpp runs (PASSIVE halved it on SmolLM2-135M).

optimum, genai, openvino and llamacpp run in private venvs (pins in ``venv.py``, verified together on
Python 3.11, CPU) through ``workers/worker.py``. Venvs and converted models (keyed by checkpoint
path, file sizes and mtimes) go under ``--work`` (default ``$SPECDEC_CACHE/peers``, else
``~/.cache/specdec/peers``), made on first use (pip's log ``<work>/<venv>.install.log``; llama.cpp
builds for ~12 min on 2 cores). ``--no-setup`` makes nothing and lists what is missing as
unavailable; a failed install or conversion makes that peer unavailable with why; the run goes on.

Prompts are ``specdec bench``'s (``--corpus``), the first ``--prompt-tokens`` tokens by the target's
``AutoTokenizer``, or with ``--corpus chat|chat-code|topics-*`` whole held-out requests through the
bundle's chat template; fed to every peer as token ids. Each request asks for exactly ``--tokens`` new
tokens, EOS ignored (transformers: no EOS id; genai: ``min_length = max_length``; OpenVINO:
``ignore_eos``; llama.cpp: ``generate`` never stops by itself); greedy at T = 0, else pure sampling
(no top-k/top-p/min-p). All libraries get ``--threads``. One 8-token warm-up per (peer, mode, T),
then rounds: every prompt with every (peer, mode, T), seeded 1000 * round + prompt, so noise hits
all alike. Timed is decoding: from the first new token(s) (prefill done) to the last, counting the
tokens after it (transformers, optimum: a ``generate`` streamer; OpenVINO: streamer ``write`` per
step; llama.cpp: ``generate``'s tokens; genai: ``generate_next_token`` less the speculative modes'
``tokens_buffered``, handed out one per call). ``specdec bench`` counts N tokens over total minus
prefill; for N >> 1 the two agree.

Reported per (peer, mode, T): tok/s, speedup over the peer's own autoregressive run, new tokens
per target pass (prefill included: a forward hook, genai's stats, OpenVINO's streamer writes,
llama.cpp's ``eval`` calls), acceptance (accepted / evaluated drafts), genai's n-gram hit rate, and
at T = 0 on how many prompts the tokens equal the first autoregressive peer's (exact speculation
agrees up to floating-point near-ties; quantized weights are another model). A mode that is
missing or fails is listed with why; no number is made up. ``--draft-tokens K`` pins every
speculative peer's width (transformers: constant schedule, no confidence early-stop); else each
keeps its own: transformers 20 with a 0.4 early-stop, genai 4, llama-cpp-python 10, OpenVINO none
(4), specdec the bundle's γ.

Reading the numbers: genai samples at T = 1 over the full vocabulary (``top_k = 0``), slow in its
CPU search (~0.5 ms per token at a 4096 vocabulary). OpenVINO GenAI 2026.4's draft model with
sampling fails an internal check for some seeds (0 among them) and corrupts output when it does not
(openvino.genai issue 4190): that row carries the error. llama.cpp meets at a barrier after every
op, which on a tiny model costs more than a second thread gains (the demo target: ~3x faster at 1
thread than 2, measured under the PASSIVE wait policy the workers then had). transformers adapts its assistant's settings across calls; each request resets them.
"""

from __future__ import annotations

from specdec.commands.bench.peers.base import Peer
from specdec.commands.bench.peers.local import HFPeer, SpecdecPeer
from specdec.commands.bench.peers.venv import GenaiPeer, LlamaCppPeer, OpenVINOPeer, OptimumPeer

# In start order (specdec last).
PEER_CLASSES: dict[str, type[Peer]] = {p.name: p for p in (HFPeer, OptimumPeer, GenaiPeer, OpenVINOPeer, LlamaCppPeer, SpecdecPeer)}
PEERS = tuple(PEER_CLASSES)
