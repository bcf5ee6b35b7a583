from __future__ import annotations

import random

from mlaserve.tokenizer import find_stop, stop_holdback


def test_single_stop_exclude_and_include() -> None:
    assert find_stop("Hello world###", 3, ["###"], include_stop=False) == (11, "###")
    assert find_stop("Hello world###", 3, ["###"], include_stop=True) == (14, "###")
    assert find_stop("Hello###world", 8, ["###"], include_stop=False) == (5, "###")
    assert find_stop("Hello###world", 8, ["###"], include_stop=True) == (8, "###")


def test_stop_split_across_steps() -> None:
    text = ""
    hits = []
    for delta in ["Hel", "lo #", "#", "# and more"]:
        text += delta
        hits.append(find_stop(text, len(delta), ["###"], include_stop=False))
    assert hits == [None, None, None, (6, "###")]


def test_only_new_text_is_searched() -> None:
    assert find_stop("### then more", 4, ["###"], include_stop=False) is None
    assert find_stop("abc", 0, ["abc"], include_stop=False) is None
    assert find_stop("abc", 3, [], include_stop=False) is None
    assert find_stop("abc", 10, ["b"], include_stop=False) == (1, "b")


def test_multiple_stops_first_completed_wins() -> None:
    # "bc" completes at index 3, before "cde" completes at 5, whatever the list order.
    assert find_stop("abcde", 5, ["cde", "bc"], include_stop=False) == (1, "bc")
    assert find_stop("abcde", 5, ["bc", "cde"], include_stop=True) == (3, "bc")
    # Same end: the longer stop wins.
    assert find_stop("xabc", 4, ["c", "abc"], include_stop=False) == (1, "abc")


def test_result_does_not_depend_on_chunking() -> None:
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 20)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(3)]
        include = rng.random() < 0.5
        results = []
        for chunked in (False, True):
            seen, hit = "", None
            i = 0
            while i < len(text) and hit is None:
                size = rng.randint(1, 5) if chunked else 1
                seen += text[i : i + size]
                i += size
                hit = find_stop(seen, min(size, len(seen)), stops, include)
            results.append(hit)
        assert results[0] == results[1], (text, stops, include)


def test_stop_holdback() -> None:
    assert stop_holdback(["###", "STOP!"], include_stop=False) == 4
    assert stop_holdback(["###"], include_stop=True) == 0
    assert stop_holdback([], include_stop=False) == 0
