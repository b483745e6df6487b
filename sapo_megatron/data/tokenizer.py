"""Tokenizers the trainer uses: the embedded demo's character tokenizer and an adapter for HF tokenizers.

Both give the same small interface: ``encode(text, add_bos=, add_eos=)``, ``decode(ids)``, ``vocab_size``,
``pad_id`` / ``bos_id`` / ``eos_id`` and ``save(directory)``.

:meth:`CharTokenizer.save` writes its own ``char_tokenizer.json`` (read by this project, e.g. the CPU rollout
server) and the same vocabulary as a Hugging Face fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``), so that an exported demo model loads with ``transformers.AutoTokenizer`` next to
``AutoModelForCausalLM``. That HF tokenizer gives the ids of :meth:`CharTokenizer.encode`: with
``add_special_tokens=True`` (transformers' default) it prepends ``<bos>`` like ``encode(text, add_bos=True)`` –
which is how the trainer encodes prompts, so ``generate`` sees exactly what the rollouts saw; with
``add_special_tokens=False`` it equals ``encode(text)``. It never appends ``<eos>`` (prompts do not end with
one; generation stops at it). A character outside the vocabulary is an error there too (the vocabulary has no
unknown token).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from sapo_megatron.errors import UserError

TOKENIZER_FILE = "char_tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# Digits, arithmetic, the answer markers the rewards understand ("=", "####"), and lower-case words.
DEFAULT_CHARS = " 0123456789+-*/=()#.,:?abcdefghijklmnopqrstuvwxyz"

HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files that make up a Hugging Face tokenizer (whichever of them a tokenizer directory has)."""


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be loaded, or text it cannot encode."""


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

    def first_unknown(self, text: str) -> tuple[int, str] | None:
        """``(position, character)`` of the first character of ``text`` outside the vocabulary, or None."""
        for position, char in enumerate(text):
            if char not in self._char_to_id:
                return position, char
        return None

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        unknown = self.first_unknown(text)
        if unknown is not None:
            position, char = unknown
            raise TokenizerError(
                f"the char tokenizer cannot encode {char!r} (position {position} of {text!r}); "
                f"it knows only {self.chars!r}"
            )
        ids = [self._char_to_id[char] for char in text]
        return [*([self.bos_id] if add_bos else []), *ids, *([self.eos_id] if add_eos else [])]

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
        """Write ``char_tokenizer.json`` and the HF tokenizer files into ``directory``; returns the former."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        path.write_text(
            json.dumps(
                {"type": "char", "version": 1, "special_tokens": list(SPECIAL_TOKENS), "chars": self.chars}
            )
        )
        self.save_hf(directory)
        return path

    def save_hf(self, directory: str | Path) -> None:
        """The vocabulary as a Hugging Face fast tokenizer (see the module docstring for its ids)."""
        directory = Path(directory)
        self.hf_backend().save(str(directory / "tokenizer.json"))
        special = {
            "pad_token": SPECIAL_TOKENS[0],
            "bos_token": SPECIAL_TOKENS[1],
            "eos_token": SPECIAL_TOKENS[2],
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": True,
            "add_eos_token": False,
            # Spaces are tokens here: transformers' clean-up would delete the one before "," or ".".
            "clean_up_tokenization_spaces": False,
            # Decoder-only generation continues the last token: batches of prompts pad on the left.
            "padding_side": "left",
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    def hf_backend(self) -> Any:
        """A ``tokenizers.Tokenizer`` with this vocabulary: one token per character, ``<bos>`` prepended by
        its post-processor, special tokens marked special (skipped by ``decode(skip_special_tokens=True)``)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
        vocab.update(self._char_to_id)
        backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
        # Every character on its own (no normaliser: the vocabulary is case- and space-sensitive).
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m:.)"), behavior="isolated")
        backend.decoder = decoders.Fuse()  # join tokens without the word-level decoder's spaces
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        bos = SPECIAL_TOKENS[self.bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, self.bos_id)]
        )
        return backend

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        path = Path(directory) / TOKENIZER_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"cannot read the char tokenizer {path}: {exc}") from exc
        if (
            not isinstance(data, dict)
            or data.get("type") != "char"
            or data.get("special_tokens") != list(SPECIAL_TOKENS)
            or not isinstance(data.get("chars"), str)
        ):
            raise TokenizerError(f"{path} is not a char tokenizer file of this version")
        return cls(data["chars"])

    def fingerprint(self) -> str:
        """Equal for tokenizers that map every text to the same ids (teacher and student must share one)."""
        return _digest({"type": "char", "special": list(SPECIAL_TOKENS), "chars": self.chars})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __hash__(self) -> int:
        return hash(self.chars)


class HFTokenizer:
    """Adapter giving an HF tokenizer the small interface the trainer uses (same as :class:`CharTokenizer`)."""

    def __init__(self, directory: str | Path, *, padded_vocab_size: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        if not any((self.directory / name).is_file() for name in HF_TOKENIZER_FILES):
            raise TokenizerError(
                f"{directory} holds no tokenizer: none of {', '.join(HF_TOKENIZER_FILES[:4])}, ... is there"
            )
        check_tokenizer_files(self.directory)
        try:
            # never run a tokenizer folder's own Python (auto_map); without the flag transformers asks on stdin
            self._tok = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
        except (OSError, ValueError) as exc:  # transformers' ways of saying "no usable tokenizer here"
            raise _load_error(directory, exc) from exc
        self.eos_id = self._tok.eos_token_id
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.bos_id = self._tok.bos_token_id
        if self.eos_id is None:
            raise TokenizerError(
                f"the tokenizer in {directory} defines no eos token; RL needs one to stop responses"
            )
        self._padded_vocab_size = padded_vocab_size

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def padded_vocab_size(self) -> int:
        """The embedding rows a model made for this tokenizer has (Qwen3's checkpoints: 151,936 for 151,669)."""
        return max(self._padded_vocab_size or 0, self.vocab_size)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (chat templates, batch encoding)."""
        return self._tok

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok(text, add_special_tokens=False)["input_ids"]
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return [*ids, self.eos_id] if add_eos else ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return cast(
            str, text
        )  # one flat id list decodes to one string (transformers types it str | list[str])

    def fingerprint(self) -> str:
        """Equal for tokenizers with the same vocabulary (token → id, added tokens included) and special ids."""
        vocab = sorted(self._tok.get_vocab().items(), key=lambda item: item[1])
        return _digest({"vocab": vocab, "special": [self.pad_id, self.bos_id, self.eos_id]})

    def save(self, directory: str | Path) -> Path:
        """Copy the tokenizer files of the directory it was loaded from, unchanged (``save_pretrained`` would
        re-serialise them, and may drop files such as a chat template it does not know)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        copied = [name for name in HF_TOKENIZER_FILES if (self.directory / name).is_file()]
        for name in copied:
            shutil.copyfile(self.directory / name, directory / name)
        if not copied:  # loaded through files of other names: let transformers write its own
            self._tok.save_pretrained(str(directory))
        return directory


def check_tokenizer_files(directory: Path) -> None:
    """Refuse a tokenizer folder whose JSON files do not parse, naming the file and the place."""
    for name in HF_TOKENIZER_FILES:
        path = directory / name
        if not name.endswith(".json") or not path.is_file():
            continue
        try:
            json.loads(path.read_bytes())
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            where = (
                f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
            )
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise TokenizerError(
                f"{path}: not valid JSON ({reason}{where})",
                hint="restore the file from the model's repository",
            ) from None


def _load_error(directory: str | Path, exc: Exception) -> TokenizerError:
    reason = " ".join(str(exc).split())  # its messages span several lines
    if "custom code" in reason or "trust_remote_code" in reason:
        return TokenizerError(
            f"the tokenizer in {directory} needs its own Python code (auto_map in tokenizer_config.json); "
            "sapo-megatron does not run code from a model folder",
            hint="use a tokenizer that transformers loads by itself (a tokenizer.json, no auto_map)",
        )
    return TokenizerError(f"cannot load the HF tokenizer in {directory}: {reason}")


def _digest(data: Any) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


Tokenizer = CharTokenizer | HFTokenizer
"""Either tokenizer (both have encode / decode, pad_id / bos_id / eos_id, vocab_size, save)."""


def load_tokenizer(spec: str) -> Tokenizer:
    """``"char"`` for the demo's character tokenizer, ``"chat"`` for the shipped byte-level BPE with a chat
    template (:mod:`~sapo_megatron.data.chat_tokenizer`), ``"qwen3"`` for the real Qwen3 tokenizer fetched by
    ``make qwen3-tokenizer`` (:mod:`~sapo_megatron.data.qwen3_tokenizer`), a directory with
    ``char_tokenizer.json``, or an HF tokenizer directory."""
    if spec == "char":
        return CharTokenizer()
    if spec == "chat":
        from sapo_megatron.data.chat_tokenizer import CHAT_TOKENIZER_DIR

        return HFTokenizer(CHAT_TOKENIZER_DIR)
    if spec == "qwen3":
        from sapo_megatron.data import qwen3_tokenizer

        return HFTokenizer(
            qwen3_tokenizer.tokenizer_dir(), padded_vocab_size=qwen3_tokenizer.PADDED_VOCAB_SIZE
        )
    if (Path(spec) / TOKENIZER_FILE).is_file():
        return CharTokenizer.load(spec)
    if not Path(spec).is_dir():
        raise TokenizerError(
            f"data.tokenizer={spec!r}: not 'char', not 'chat', not 'qwen3' and not a directory "
            "(give 'char', 'chat', 'qwen3' or a directory holding tokenizer.json / tokenizer_config.json)"
        )
    return HFTokenizer(spec)
