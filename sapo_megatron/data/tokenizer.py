"""A character-level tokenizer for the embedded demo: a fixed, tiny vocabulary, saved as one small JSON file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

TOKENIZER_FILE = "char_tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# Digits, arithmetic, the answer markers the rewards understand ("=", "####"), and lower-case words.
DEFAULT_CHARS = " 0123456789+-*/=()#.,:?abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """One id per character; ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``, characters follow in order."""

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer: characters must be unique, got {chars!r}")
        self.chars = chars
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._offset = len(SPECIAL_TOKENS)
        self._char_to_id = {c: i + self._offset for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return self._offset + len(self.chars)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for position, char in enumerate(text):
            token = self._char_to_id.get(char)
            if token is None:
                raise ValueError(
                    f"CharTokenizer: character {char!r} at position {position} of {text!r} is not in the vocabulary"
                )
            ids.append(token)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        out = []
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"CharTokenizer: token id {token} is outside [0, {self.vocab_size})")
            if token < self._offset:
                if not skip_special_tokens:
                    out.append(SPECIAL_TOKENS[token])
                continue
            out.append(self.chars[token - self._offset])
        return "".join(out)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {"type": "char", "version": 1, "special_tokens": list(SPECIAL_TOKENS), "chars": self.chars}
            )
        )
        return path

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        path = Path(directory) / TOKENIZER_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"CharTokenizer: cannot read {path}: {exc}") from exc
        if (
            data.get("type") != "char"
            or data.get("special_tokens") != list(SPECIAL_TOKENS)
            or not isinstance(data.get("chars"), str)
        ):
            raise ValueError(f"CharTokenizer: {path} is not a char tokenizer file of this version")
        return cls(data["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __hash__(self) -> int:
        return hash(self.chars)


class HFTokenizer:
    """Adapter giving an HF tokenizer the small interface the trainer uses (same as :class:`CharTokenizer`)."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(directory))
        self.eos_id = self._tok.eos_token_id
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.bos_id = self._tok.bos_token_id
        if self.eos_id is None:
            raise ValueError(f"tokenizer in {directory} defines no eos token; RL needs one to stop responses")

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok(text, add_special_tokens=False)["input_ids"]
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return [*ids, self.eos_id] if add_eos else ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path) -> Path:
        self._tok.save_pretrained(str(directory))
        return Path(directory)


def load_tokenizer(spec: str) -> CharTokenizer | HFTokenizer:
    """``"char"`` for the demo's character tokenizer, a directory with ``char_tokenizer.json``, or an HF
    tokenizer directory."""
    if spec == "char":
        return CharTokenizer()
    if (Path(spec) / TOKENIZER_FILE).is_file():
        return CharTokenizer.load(spec)
    if not Path(spec).is_dir():
        raise ValueError(f"data.tokenizer={spec!r}: not 'char' and not a tokenizer directory")
    return HFTokenizer(spec)
