"""The benchmark's prompts.

Two corpora:

- ``stdlib``: CPython stdlib files, split into training and held-out files as the demo pair was
  trained (the split rule lives only here); prompts are the openings of held-out files.
- ``code``: function openings from third-party packages that every specdec install has (numpy,
  click, tqdm, onnxruntime's Python layer) — code the demo pair never saw in training, a harder
  and more honest test of a draft trained on the stdlib.
- ``functions`` / ``code-functions``: whole functions of the held-out stdlib files / of the
  third-party packages, as *sources* for encoder-decoder bundles (the seq2seq demo pair
  rewrites a function with its local names normalized).

And for chat models (the SmolLM2 benchmarks), requests written here: ``HELD_OUT``, everyday
chat, and ``HELD_OUT_CODE``, coding requests; no training prompt of the SmolLM2 draft was either.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from specdec.held_out import EXCLUDED, HELD_OUT, HELD_OUT_CODE, held_out_prompts, stdlib_files  # re-exported

CODE_PACKAGES = ("numpy", "click", "tqdm", "onnxruntime")
CORPORA = ("stdlib", "code", "functions", "code-functions")
SOURCE_CORPORA = ("functions", "code-functions")  # sources for encoder-decoder bundles
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]", re.MULTILINE)


def package_files(package: str) -> list[Path]:
    """A package's ``.py`` files (no tests, no vendored code), sorted; [] when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    return [f for f in sorted(root.rglob("*.py")) if not EXCLUDED & set(f.relative_to(root).parts)]


def code_prompts(encode, count: int, length: int, packages: tuple[str, ...] = CODE_PACKAGES) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, each the opening of a function (its ``def`` line
    on) in a third-party package, one per file, taken round-robin over ``packages`` so no package
    dominates. A function is used when the text from its ``def`` has at least 2 x ``length``
    tokens (the continuation is real code)."""
    return _round_robin([iter(package_files(p)) for p in packages], count, lambda files: _first_function(files, encode, length))


def _round_robin(queues: list, count: int, take) -> list[list[int]]:
    """Up to ``count`` items, ``take(queue)`` from each queue of files in turn (None: that queue
    has run out), so no queue dominates."""
    out: list[list[int]] = []
    while queues and len(out) < count:
        for q in list(queues):
            item = take(q)
            if item is None:
                queues.remove(q)
            else:
                out.append(item)
            if len(out) == count:
                break
    return out


def _first_function(files, encode, length: int) -> list[int] | None:
    """The next file's first function opening long enough, or None when ``files`` runs out."""
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in _DEF.finditer(text):
            body = text[m.start() :].lstrip(" \t")
            ids = encode(body[: length * 40])  # enough characters for 2 x length tokens
            if len(ids) >= length * 2:
                return ids[:length]
    return None


def function_sources(encode, count: int, length: int, packages: tuple[str, ...] | None = None) -> list[list[int]]:
    """``count`` whole functions (``def`` to the end of the body, dedented) of ``length // 2`` to
    ``length`` tokens, one per file: of the held-out stdlib files, or round-robin over
    ``packages``. Sources for encoder-decoder bundles."""
    queues = [iter(stdlib_files(held_out=True))] if packages is None else [iter(package_files(p)) for p in packages]
    return _round_robin(queues, count, lambda files: next((ids for f in files for ids in _functions(f, encode) if length // 2 <= len(ids) <= length), None))


def _functions(f: Path, encode):
    """Token ids of each function in file ``f``, in order (none when it does not parse)."""
    import ast
    import textwrap

    text = f.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            segment = ast.get_source_segment(text, node, padded=True)
            if segment:
                yield encode(textwrap.dedent(segment))


def prompts(corpus: str, encode, count: int, length: int) -> list[list[int]]:
    """Prompts from ``corpus``: "stdlib" held-out files, third-party "code", or whole functions
    (sources for encoder-decoder bundles, up to ``length`` tokens) of held-out stdlib files
    ("functions") or third-party packages ("code-functions")."""
    from specdec.errors import InputError

    if corpus not in CORPORA:
        raise InputError(f"corpus {corpus!r}: expected one of {', '.join(CORPORA)}")
    if corpus == "code-functions":
        return function_sources(encode, count, length, CODE_PACKAGES)
    return {"stdlib": held_out_prompts, "code": code_prompts, "functions": function_sources}[corpus](encode, count, length)


CHAT_KINDS = ("chat", "code", "topics-chat", "topics-code")
CHAT_CORPORA = {"chat": "chat", "chat-code": "code", "topics-chat": "topics-chat", "topics-code": "topics-code"}  # specdec bench --corpus -> kind ("code" there is function openings)


def chat_texts(kind: str, count: int | None = None) -> list[str]:
    """The first ``count`` held-out requests of ``kind``: "chat" (everyday questions, HELD_OUT),
    "code" (coding requests, HELD_OUT_CODE), or "topics-chat"/"topics-code": requests of the
    self-distillation recipe's own forms on topics it holds out (specdec/commands/distill/prompts.py)."""
    if kind.startswith("topics-"):
        from specdec.commands.distill.prompts import held_out

        return held_out(kind.removeprefix("topics-"), count or 16)
    return list({"chat": HELD_OUT, "code": HELD_OUT_CODE}[kind][:count])


def chat_prompts(bundle: Path, manifest, codec, kind: str = "chat", count: int | None = None) -> list[list[int]]:
    """``chat_texts(kind, count)`` as user turns through the bundle's chat template."""
    from specdec.errors import InputError
    from specdec.serve.chat import bundle_template

    chat = bundle_template(bundle, manifest, codec)
    if chat is None:
        raise InputError(f"bundle {bundle} has no chat template; chat prompts need one (export a tokenizer that has it)")
    texts = chat_texts(kind, count)
    return [codec.encode(chat.render([{"role": "user", "content": t}])) for t in texts]
