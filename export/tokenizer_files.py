"""A tokenizer saved so that transformers 4.x and 5.x both load it.

transformers 5 names every fast tokenizer's class ``TokenizersBackend`` in the
``tokenizer_config.json`` it writes; 4.x has no such class and refuses the folder ("Tokenizer
class TokenizersBackend does not exist"). 5.x keeps ``PreTrainedTokenizerFast`` as another name
for the same class, so a bundle's tokenizer is written under that name: a bundle exported with
one major version loads its tokenizer with the other (``AutoTokenizer``, lm-eval, peers' venvs).
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = "tokenizer_config.json"
RENAMED = {"TokenizersBackend": "PreTrainedTokenizerFast"}  # transformers 5's name -> the one both versions know


def save_tokenizer(tokenizer, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)``, its class named as both major versions load it."""
    tokenizer.save_pretrained(str(folder))
    path = Path(folder) / CONFIG
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") in RENAMED:
        config["tokenizer_class"] = RENAMED[config["tokenizer_class"]]
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
