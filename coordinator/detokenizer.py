"""Token ids to text for the HTTP API: incremental detokenization that only ever emits whole
characters, and the string and bytes of single tokens for logprobs."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """vLLM's prefix/read offsets: each step decodes a short window of recent tokens and emits
    the text past what the window's head already produced, holding back bytes until they form
    whole characters. The concatenated deltas (and the flush) equal the decoded output."""

    CONTEXT_TOKENS = 5  # prompt tokens decoded with the output, so a leading space survives

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # a prompt ending mid-character must not swallow the output's bytes
        self.token_ids: list[int] = context
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(context)  # end of the text already emitted
        self.text = ""  # everything emitted so far

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one token; returns the new complete text (often empty)."""
        self.token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is held back, an incomplete character as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(REPLACEMENT)):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: the characters of byte-level BPE
    vocabularies back to the bytes they stand for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenVocabulary:
    """The bytes and the display string of a single token (for logprobs). A token that is not
    whole UTF-8 is shown as OpenAI does: `bytes:\\xe6\\x97`."""

    def __init__(self, tokenizer: Tokenizer, model_dir: str | Path) -> None:
        self.tokenizer = tokenizer
        spec = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        self.added = {t["id"]: t["content"] for t in spec.get("added_tokens") or []}
        self.byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        self._alphabet = _byte_level_alphabet() if self.byte_level else {}
        self._cache: dict[int, tuple[bytes, str]] = {}

    def _lookup(self, token_id: int) -> tuple[bytes, str]:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        raw = self._bytes(token_id)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        self._cache[token_id] = (raw, text)
        return raw, text

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word-start marker

    def token_bytes(self, token_id: int) -> bytes:
        return self._lookup(token_id)[0]

    def token_str(self, token_id: int) -> str:
        return self._lookup(token_id)[1]
