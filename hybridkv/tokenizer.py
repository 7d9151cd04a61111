"""A thin wrapper over a `tokenizers` tokenizer.json (plus tokenizer_config.json if present).

A checkpoint without tokenizer.json runs in token-id mode (`load_tokenizer` gives None):
prompts are lists of token ids and outputs carry token ids with empty text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json")
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own exception types
            raise ValueError(f"cannot read {path}: {exc}") from None
        self.config: dict[str, Any] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                self.config = json.loads(cfg_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"cannot read {cfg_path}: {exc}") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it), so a long prompt
        # tokenized in a worker thread does not stall the server's event loop.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        template = self.config.get("chat_template")
        return template if isinstance(template, str) else None


def load_tokenizer(folder: Path) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has no tokenizer.json (token-id mode). A
    tokenizer.json that is there but cannot be read is a ValueError, as in `Tokenizer`."""
    path = folder / "tokenizer.json"
    if not path.exists() and not path.is_symlink():
        return None
    return Tokenizer(folder)
