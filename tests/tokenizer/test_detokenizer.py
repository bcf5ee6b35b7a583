from __future__ import annotations

import random

import pytest

from mlaserve.config import default_model_path
from mlaserve.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.tokenizer.tiny_tokenizer import CORPUS, bytes_to_unicode


@pytest.fixture(params=[True, False], ids=["decode_stream", "python_window"])
def stream(request: pytest.FixtureRequest) -> bool:
    """Both paths: tokenizers' DecodeStream (fast tokenizers) and the Python window (others)."""
    return request.param


TEXTS = ["héllo wörld 你好 🙂", "naïve 🙂🙂 crème", "你好世界", "x🙂y", "plain ascii"]


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte: every multi-byte character is split."""
    table = bytes_to_unicode()
    ids = [tok.hf.convert_tokens_to_ids(table[b]) for b in text.encode()]
    assert None not in ids and tok.hf.unk_token_id not in ids
    return ids


def run(det: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4) if rng else 1
        deltas.append(det.step(ids[i : i + size]))
        i += size
    return deltas


def test_matches_full_decode_for_random_sequences(stream: bool, tok: Tokenizer) -> None:
    rng = random.Random(0)
    specials = set(tok.all_special_ids)
    normal = [i for i in range(tok.vocab_size) if i not in specials]
    for trial in range(300):
        prompt = tok.encode(rng.choice(CORPUS)[: rng.randint(0, 20)])
        pool = normal if trial % 3 else list(range(tok.vocab_size))  # some with special tokens
        output = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        skip = trial % 2 == 0
        det = IncrementalDetokenizer(
            tok, prompt, skip_special_tokens=skip, use_decode_stream=stream
        )
        deltas = run(det, output, rng if trial % 4 == 0 else None)
        deltas.append(det.flush())
        full = tok.decode(output, skip_special_tokens=skip)
        assert "".join(deltas) == full == det.text, (prompt, output)
        assert det.output_ids == output


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", ["bytes", "bpe"])
def test_never_emits_replacement_char_for_valid_utf8(
    stream: bool, tok: Tokenizer, text: str, split: str
) -> None:
    ids = byte_ids(tok, text) if split == "bytes" else tok.encode(text, add_special_tokens=False)
    for seed in range(5):
        det = IncrementalDetokenizer(tok, tok.encode("hello "), use_decode_stream=stream)
        deltas = run(det, ids, random.Random(seed) if seed else None)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == text == det.text
        assert det.flush() == ""


def test_holds_back_an_incomplete_character(stream: bool, tok: Tokenizer) -> None:
    ids = byte_ids(tok, "a你")  # 'a', then the 3 bytes of 你
    det = IncrementalDetokenizer(tok, [], use_decode_stream=stream)
    assert [det.step([i]) for i in ids] == ["a", "", "", "你"]


def test_flush_emits_what_was_held(stream: bool, tok: Tokenizer) -> None:
    ids = byte_ids(tok, "a你")[:3]  # the last character never completes
    det = IncrementalDetokenizer(tok, tok.encode("x"), use_decode_stream=stream)
    assert det.step(ids) == "a"
    assert det.flush() == "\ufffd"
    assert det.text == "a\ufffd" == tok.decode(ids)


def test_special_tokens(stream: bool, tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    assert eos is not None
    hello = tok.encode("hello", add_special_tokens=False)
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True, use_decode_stream=stream)
    assert "".join(run(skipped, [*hello, eos])) + skipped.flush() == "hello"
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False, use_decode_stream=stream)
    assert "".join(run(kept, [*hello, eos])) + kept.flush() == "hello<eos>"


def test_decode_stream_and_python_window_agree_on_the_default_model() -> None:
    """The shipped (DeepSeek-style byte-level) tokenizer: the same deltas, step by step, on
    random ids, specials included, after prompts cut at random places."""
    tok = Tokenizer.from_pretrained(default_model_path())
    rng = random.Random(1)
    text = " ".join(CORPUS) + " def f(x):\n    return x ** 2  # ünïcödé ✓"
    ids = tok.encode(text)
    for trial in range(100):
        cut = rng.randint(0, len(ids) - 1)
        prompt = ids[:cut]
        output = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        if trial % 2:
            output = ids[cut : cut + 40]  # real text, split wherever the prompt was cut
        skip = trial % 3 != 0
        fast, slow = (
            IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, use_decode_stream=s)
            for s in (True, False)
        )
        for token in output:
            assert fast.step([token]) == slow.step([token]), (prompt, output)
        assert fast.flush() == slow.flush()
        assert fast.text == slow.text


def test_a_prompt_ending_inside_a_character(stream: bool, tok: Tokenizer) -> None:
    """Raw-id prompts may end halfway through a character; the output still decodes."""
    ids = byte_ids(tok, "a你b")
    det = IncrementalDetokenizer(tok, ids[:2], use_decode_stream=stream)
    deltas = [det.step([i]) for i in ids[2:]]
    assert "".join(deltas) + det.flush() == det.text
    assert det.text.endswith("b")
