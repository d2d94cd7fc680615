"""``ChatTokenizer.stream_texts`` (the text each sampled id adds, for streamed turns): exact, linear, mended."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models

from rollout_ledger.services.env_worker.sessions.turns import token_texts
from rollout_ledger.shared.kit.chat import ChatTokenizer, _agree, load_chat_tokenizer

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


def per_prefix(tok: ChatTokenizer, ids: Sequence[int]) -> list[str]:
    """The reference: decode every prefix (the former implementation, quadratic)."""
    out = []
    prev = ""
    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            out.append("")
            continue
        out.append(text[len(prev):])
        prev = text
    if out:
        out[-1] += tok.decode(ids, skip_special_tokens=True)[len(prev):]
    return out


def _ids(tok: ChatTokenizer, text: str) -> list[int]:
    return [int(i) for i in tok.encode(text).tolist()]


@pytest.mark.parametrize("text", ["plain ascii", "ünïcödé 🎲🎲 and 漢字", "", "  leading and  double  spaces \n\n",
                                  "a<|im_end|>b <|im_start|>c 🎲", "日本語のテキスト 👨‍👩‍👧 ok", "\ufffd literal"])
def test_pieces_match_the_per_prefix_reference(tok: ChatTokenizer, text: str) -> None:
    ids = [*_ids(tok, text), tok.tokenizer.token_to_id(EOS)]
    pieces = tok.stream_texts(ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert pieces == per_prefix(tok, ids) == token_texts(tok, ids)


@pytest.mark.parametrize(("char", "split"), [("🎲", 3), ("漢", 3), ("字", 3), ("😀", 2), ("𝄞", 3), ("é", 1)])
def test_a_character_split_across_ids_comes_with_the_id_completing_it(tok: ChatTokenizer, char: str,
                                                                      split: int) -> None:
    ids = _ids(tok, f"x {char}y")
    pieces = tok.stream_texts(ids)
    assert pieces[0] == "x" and pieces[-1] == "y" and "".join(pieces) == f"x {char}y"
    middle = pieces[1:-1]  # the ids of " {char}": the last carries the character, those before it nothing of it
    assert len(middle) >= split and middle[-1].endswith(char)
    assert all(p in ("", " ") for p in middle[:-1]) and middle[-split:-1] == [""] * (split - 1)


def test_special_tokens_give_empty_pieces(tok: ChatTokenizer) -> None:
    start, end = tok.tokenizer.token_to_id("<|im_start|>"), tok.tokenizer.token_to_id(EOS)
    ids = [start, *_ids(tok, "assistant"), end, *_ids(tok, "hi 🎲"), end]
    pieces = tok.stream_texts(ids)
    assert pieces[0] == "" and pieces[-1] == "" and pieces[len(_ids(tok, "assistant")) + 1] == ""
    assert "".join(pieces) == "assistanthi 🎲"
    assert tok.stream_texts([end, end]) == ["", ""] and tok.stream_texts([]) == []


def test_a_turn_cut_inside_a_character_ends_with_the_replacement_chars(tok: ChatTokenizer) -> None:
    ids = _ids(tok, "ok 🎲")[:-1]  # stopped by max_tokens in the middle of the emoji
    pieces = tok.stream_texts(ids)
    full = tok.decode(ids, skip_special_tokens=True)
    assert full.endswith("\ufffd") and "".join(pieces) == full and pieces == per_prefix(tok, ids)


def test_a_long_turn(tok: ChatTokenizer) -> None:
    paragraph = "The parcel left Zürich on Tuesday 🚚; 東京の倉庫からも確認します — naïve café.\n"
    ids = [*_ids(tok, paragraph * 200)[:4095], tok.tokenizer.token_to_id(EOS)]
    pieces = tok.stream_texts(ids)
    assert len(pieces) == 4096 and "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert pieces[:600] == per_prefix(tok, ids[:600])  # the reference is quadratic: checked on a prefix


def test_the_whole_turn_is_decoded_once(tok: ChatTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """No per-prefix decoding: one whole decode for the final check, whatever the turn's length."""
    calls: list[int] = []
    real = tok.decode

    def spy(ids: Any, skip_special_tokens: bool = False) -> str:
        calls.append(len(ids))
        return real(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    ids = _ids(tok, "a fairly long answer, with 漢字 and 🎲, " * 50)
    tok.stream_texts(ids)
    assert calls == [len(ids)]


# --- the mend, on toy tokenizers whose decoders rewrite text across ids -----------------------------------
def _toy(tmp_path: Path, decoder: decoders.Decoder) -> ChatTokenizer:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "d": 4}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.decoder = decoder
    inner.add_special_tokens(["<eos>"])
    inner.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return ChatTokenizer(tmp_path, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize(("replace", "ids", "expected"), [
    # the stream spells "dabcd": its window never holds the whole pattern
    (("abc", "X"), [4, 1, 2, 3, 4, 5], ["d", "", "", "", "", "Xd"]),
    # the window's text stops extending what was sent ("a" then "Yc"): DecodeStream raises
    (("ab", "Y"), [4, 1, 2, 3, 4], ["d", "", "", "", "Ycd"]),
    (("ab", "Y"), [1, 2], ["", "Y"]),
])
def test_pieces_are_mended_where_the_stream_parts_from_the_whole_decode(
        tmp_path: Path, replace: tuple[str, str], ids: list[int], expected: list[str]) -> None:
    toy = _toy(tmp_path, decoders.Sequence([decoders.Fuse(), decoders.Replace(*replace)]))
    pieces = toy.stream_texts(ids)
    assert pieces == expected and "".join(pieces) == toy.decode(ids, skip_special_tokens=True)


def test_agree() -> None:
    assert _agree(["a", "b", "c"], "abc") == ["a", "b", "c"]
    assert _agree(["a", "b", ""], "abcd") == ["a", "b", "cd"]  # missing tail: to the last piece
    assert _agree(["ab", "cd", "ef"], "abXdef") == ["ab", "", "Xdef"]  # parted inside the second piece
    assert _agree(["ab", "cd", "ef"], "abc") == ["ab", "c", ""]  # the whole decode is shorter
    assert _agree(["ab", "cd"], "") == ["", ""]
    assert _agree([], "") == []
