"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar,
exactly, under speculation. The grammar engine is llguidance (what onnxruntime-genai and
llama.cpp use); this module only keeps its matcher in step with the tokens a row holds.

    StructuredOutputs(json=... | regex=... | choice=[...] | grammar=... | json_object=True)
        what a caller asks (vLLM's ``structured_outputs`` fields), checked when built
    Grammars(tokenizer, vocab, eos).state(spec) -> GrammarState
        compiled once per spec (an LRU of compiled matchers), one fresh copy per request
    GrammarState.mask_chain(logits, seq, start)   row i predicts seq[start + i]
    GrammarState.mask_tree(logits, seq, length, tokens, parents)
    GrammarState.forced(seq, length, limit)      the tokens the grammar forces next

How speculation stays exact. A row of logits predicting position t is masked by the grammar's
state after seq[:t], its own prefix, drafted tokens included: the same rule as the penalties
(runtime/penalties.py), so the draft's q and the target's p are masked alike and Algorithm 1
tests each draft token against the target's *masked* distribution. The matcher follows the
prefix asked for: it rolls back to where its tokens and the prefix part, then consumes the
rest (``sync``), so a rejection needs no bookkeeping. A drafted token the grammar refuses gets
p = 0 and is rejected; the rows after it are left unmasked (they are never read). Tokens the
grammar forces (braces, keys) are proposed as drafts (``forced``): the target checks them like
any draft, so a tokenization the target prefers over the forced one is still its own choice.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specdec.errors import ConfigError, InputError
from specdec.runtime.tree import path_to

# JSON as Python's json.dumps writes it (", " and ": "), no free whitespace: a small model left
# free whitespace can emit newlines until max_tokens; a fixed layout costs no validity
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
CACHE_SIZE = 64  # compiled grammars kept per tokenizer
MAX_SPEC_CHARS = 200_000  # a schema, regex or grammar longer than this is refused before compiling
MAX_CHOICES = 4096


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint, named as vLLM's ``StructuredOutputsParams``: ``json`` (a JSON
    schema, as a dict or its text), ``regex``, ``choice`` (the output is one of these strings),
    ``grammar`` (Lark, as llguidance reads it, or GBNF, recognized by its ``::=``) or
    ``json_object`` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InputError(f"structured_outputs sets {', '.join(given) or 'nothing'}: expected exactly one of json, regex, choice, grammar, json_object")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InputError(f"structured_outputs.json is not valid JSON ({e}); pass a JSON schema object") from None
            if not isinstance(schema, (dict, bool)):
                raise InputError(f"structured_outputs.json={str(self.json)[:60]!r}: expected a JSON schema object")
            object.__setattr__(self, "json", schema)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise InputError(f"structured_outputs.{name}={v!r}: expected a non-empty string")
        if self.choice is not None:
            c = self.choice
            if isinstance(c, (str, bytes)) or not hasattr(c, "__iter__"):
                raise InputError(f"structured_outputs.choice={c!r}: expected a list of strings")
            c = tuple(c)
            if not c or len(c) > MAX_CHOICES or not all(isinstance(s, str) and s for s in c):
                raise InputError(f"structured_outputs.choice: expected 1..{MAX_CHOICES} non-empty strings, got {len(c)} items")
            object.__setattr__(self, "choice", c)
        if len(self.key) > MAX_SPEC_CHARS:
            raise InputError(f"structured_outputs is {len(self.key)} characters long: the limit is {MAX_SPEC_CHARS}; send a smaller schema or grammar")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n) not in (None, False))

    @property
    def key(self) -> str:
        """One string per constraint (the compiled-grammar cache's key)."""
        value = getattr(self, self.kind)
        return self.kind + ":" + (json.dumps(value, sort_keys=True) if self.kind in ("json", "choice") else str(value))

    def grammar_text(self) -> str:
        """llguidance's grammar for it (compiled and checked by ``Grammars``)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            if self.kind in ("json", "json_object"):
                schema = self.json if self.kind == "json" else {"type": "object"}
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.regex)
            if self.kind == "choice":
                return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s, ensure_ascii=False) for s in self.choice))
            text = gbnf_to_lark(self.grammar) if "::=" in self.grammar else self.grammar
            return LLMatcher.grammar_from_lark(text)
        except Exception as e:  # llguidance raises ValueError / its own errors on a malformed spec
            raise InputError(f"structured_outputs.{self.kind} could not be read: {one_line(e)}") from None

    @classmethod
    def of(cls, value: Any) -> StructuredOutputs | None:
        """From a mapping of its fields (what JSON carries), itself, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InputError(f"structured_outputs={str(value)[:60]!r}: expected an object with one of json, regex, choice, grammar, json_object")
        unknown = sorted(set(value) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise InputError(f"structured_outputs.{unknown[0]}: not a field; expected one of json, regex, choice, grammar, json_object")
        return cls(**value)


def one_line(e: BaseException | str) -> str:
    """An error as one line: its first line and the ``error:`` line of a parser's report."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    if not lines:
        return type(e).__name__
    cause = next((s.removeprefix("error:").strip() for s in lines[1:] if s.startswith("error:")), None)
    return (lines[0] + (f" {cause}" if cause else ""))[:300]


def byte_level_decoder(tokenizer_json: str) -> str:
    """The tokenizer.json text llguidance reads: a byte-level BPE whose decoder is a Sequence
    holding a ByteLevel step (what transformers writes for a GGUF's tokenizer) gets that step
    alone as its decoder. llguidance reads token bytes off the decoder's type; behind a Sequence
    it would take 'Ġ' for the bytes C4 A0 instead of a space. Anything else is left as it is."""
    spec = json.loads(tokenizer_json)
    steps = (spec.get("decoder") or {}).get("decoders") or []
    byte_level = [d for d in steps if isinstance(d, dict) and d.get("type") == "ByteLevel"]
    if not byte_level:
        return tokenizer_json
    spec["decoder"] = byte_level[0]
    return json.dumps(spec)


def check_token_bytes(tokenizer, tokenizer_json: str) -> None:
    """Refuse a tokenizer whose tokens llguidance reads as other bytes than ``tokenizers``
    decodes them: its masks would allow the wrong tokens. Every token that decodes to whole
    characters alone is compared (~0.1 s at 49k tokens)."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(tokenizer_json)
    for i in range(min(hf.get_vocab_size(), tokenizer.vocab_size)):
        text = hf.decode([i], skip_special_tokens=True)
        if text and "\ufffd" not in text and tokenizer.decode_bytes([i]).decode("utf-8", "replace") != text:
            raise ConfigError(f"structured outputs cannot use this bundle's tokenizer: token {i} is {text!r} but llguidance reads "
                              f"{tokenizer.decode_bytes([i])!r}; report the tokenizer (its decoder is not one llguidance reads)")  # fmt: skip


def parser_limits():
    """What one request's grammar may cost (llguidance's units; its defaults but a smaller
    lexer): a hostile schema fails to compile in well under a second instead of stalling."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                          max_lexer_states=50_000, max_grammar_size=200_000, verbose_errors=False)  # fmt: skip


class Grammars:
    """Compiled grammars for one tokenizer: ``state(spec)`` gives a request its own matcher.

    ``tokenizer_json``: the bundle's tokenizer.json text; ``vocab``: the model's vocabulary
    (masks cover it whole; ids past the tokenizer's are never allowed); ``eos``: the tokens that
    end an output the grammar accepts."""

    def __init__(self, tokenizer_json: str, vocab: int, eos: Sequence[int]):
        try:
            from llguidance import LLTokenizer
        except ImportError:
            raise ConfigError("structured outputs need llguidance: pip install llguidance") from None
        self.vocab, self.eos = vocab, tuple(eos)
        self.tokenizer = LLTokenizer(byte_level_decoder(tokenizer_json), n_vocab=vocab, eos_token=list(self.eos) or None)
        check_token_bytes(self.tokenizer, tokenizer_json)
        self.limits = parser_limits()
        self.cache: OrderedDict[str, Any] = OrderedDict()  # key -> a compiled matcher nobody advances
        self.lock = threading.Lock()

    def state(self, spec: StructuredOutputs, prompt_len: int) -> GrammarState:
        return GrammarState(self.matcher(spec), prompt_len, self.vocab, self.eos)

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher of ``spec`` (a copy of its compiled template)."""
        return self.compile(spec).deep_copy()

    def compile(self, spec: StructuredOutputs):
        """``spec``'s compiled template, cached (nobody advances it); an ``InputError`` for a bad spec."""
        from llguidance import LLMatcher

        with self.lock:
            template = self.cache.get(spec.key)
            if template is not None:
                self.cache.move_to_end(spec.key)
                return template
        grammar = spec.grammar_text()
        template = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if template.is_error():
            error = one_line(template.get_error())
            hint = "; remove those keywords from the schema (they cannot be enforced while decoding)" if "Unimplemented keys" in error else ""
            raise InputError(f"structured_outputs.{spec.kind} was refused: {error}{hint}")
        with self.lock:
            self.cache[spec.key] = template
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return template


class GrammarState:
    """One request's matcher, following the prefixes it is asked to mask for (module docstring).

    ``done``: the output tokens the matcher has consumed (seq[prompt_len:prompt_len + len(done)])."""

    def __init__(self, matcher, prompt_len: int, vocab: int, eos: Sequence[int]):
        self.matcher, self.prompt_len, self.vocab = matcher, prompt_len, vocab
        self.eos = np.asarray(eos, dtype=np.int64)
        self.done: list[int] = []
        self.words = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)  # [1, W] llguidance's bitmask
        self.seconds = 0.0  # in masks and matcher steps (Stats.grammar_seconds)

    def sync(self, output: np.ndarray) -> bool:
        """Make the matcher's consumed tokens ``output`` (the tokens after the prompt); False
        when the grammar refuses one of them (the matcher then holds the valid prefix)."""
        done, m, out = self.done, self.matcher, output.tolist()
        n = min(len(done), len(out))
        same = n if done[:n] == out[:n] else next(i for i in range(n) if done[i] != out[i])
        if same < len(done):
            m.rollback(len(done) - same)
            del done[same:]
        new = out[same:]
        if not new:
            return True
        took = m.try_consume_tokens(new)
        done += new[:took]
        return took == len(new)

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens the grammar allows after what the matcher consumed; the stop
        tokens when it allows nothing (a finished grammar whose EOS was already drawn)."""
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        ok = np.unpackbits(self.words.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)  # [V]
        if not ok.any():
            ok[self.eos] = True
        return ok

    @contextmanager
    def timed(self):
        """Counts the time inside into ``seconds``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def mask_chain(self, logits: np.ndarray, seq: np.ndarray, start: int) -> np.ndarray:
        """``logits`` [n, V] (float64, changed in place and returned) with row i masked by the
        grammar after seq[:start + i]."""
        p = self.prompt_len
        with self.timed():
            if not self.sync(seq[p:start]):
                return logits  # an invalid prefix: these rows follow a refused draft and are never read
            for i in range(logits.shape[0]):
                if i and not self.sync(seq[p : start + i]):
                    break
                logits[i, ~self.allowed()] = -np.inf
        return logits

    def mask_tree(self, logits: np.ndarray, seq: np.ndarray, length: int, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """A tree call's ``logits`` [n + 1, V] (float64, in place): row 0 masked after
        seq[:length], row i + 1 after seq[:length] and the path from the root to node i."""
        before = seq[self.prompt_len : length]
        with self.timed():
            if not self.sync(before):
                return logits
            logits[0, ~self.allowed()] = -np.inf
            for i in range(len(tokens)):
                if self.sync(np.concatenate([before, np.asarray(path_to(tokens, parents, i), dtype=seq.dtype)])):
                    logits[i + 1, ~self.allowed()] = -np.inf
        return logits

    def forced(self, seq: np.ndarray, length: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after seq[:length] (llguidance's
        fast-forward tokens: its canonical tokenization of the forced bytes)."""
        with self.timed():
            if limit < 1 or not self.sync(seq[self.prompt_len : length]):
                return []
            return self.matcher.compute_ff_tokens()[:limit]

    def accepting(self, output: np.ndarray) -> bool:
        """Whether ``output`` is a complete match (the grammar allows it to end there)."""
        return self.sync(output) and self.matcher.is_accepting()
