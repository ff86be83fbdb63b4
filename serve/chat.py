"""Chat messages -> prompt text, with the bundle's Jinja chat template (as transformers renders it)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from specdec.errors import BundleError, InputError


class ChatTemplate:
    """A Jinja chat template rendered in a sandbox with transformers' conventions: ``messages``,
    ``add_generation_prompt``, ``bos_token``/``eos_token`` and the helpers ``raise_exception``
    and ``strftime_now``. The rendered text carries its own special tokens."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None, origin: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise BundleError(f"chat template {origin} does not parse ({e}); fix it or pass another with --chat-template") from None
        self.special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self.origin, self.source = origin, source

    @classmethod
    def from_file(cls, path: Path, bos_token: str | None, eos_token: str | None) -> ChatTemplate:
        try:
            source = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise BundleError(f"chat template {str(path)!r} cannot be read ({e.__class__.__name__}); pass a readable Jinja file") from None
        return cls(source, bos_token, eos_token, str(path))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text; an ``InputError`` when the template refuses the conversation."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **extra)
        except TemplateError as e:
            raise InputError(f"messages: the chat template refused them: {e}") from None


def bundle_template(bundle: Path, manifest, codec, path: Path | None = None) -> ChatTemplate | None:
    """The chat template at ``path``, else the bundle's own; None when there is neither. Its
    ``bos_token``/``eos_token`` are the bundle tokenizer's names for the manifest's ids."""
    from specdec.manifest import inside

    if path is None and not manifest.chat_template:
        return None
    name = (lambda i: codec.tokenizer.id_to_token(i) if codec and i is not None else None)  # noqa: E731
    eos = manifest.eos_token_ids[0] if manifest.eos_token_ids else None
    return ChatTemplate.from_file(path or inside(bundle, manifest.chat_template), name(manifest.bos_token_id), name(eos))


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
