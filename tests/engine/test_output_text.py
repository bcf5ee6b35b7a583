from __future__ import annotations

import random

from mlaserve.engine.output_text import OutputText


def test_matches_a_string_under_random_appends_tails_and_truncations() -> None:
    rng = random.Random(0)
    for _ in range(200):
        text, expected = OutputText(), ""
        for _ in range(rng.randint(0, 40)):
            op = rng.random()
            if op < 0.6:
                delta = "".join(rng.choice("ab你🙂") for _ in range(rng.randint(0, 4)))
                text.append(delta)
                expected += delta
            elif op < 0.8:
                cut = rng.randint(0, len(expected) + 2)
                text.truncate(cut)
                expected = expected[:cut]
            else:
                str(text)  # joins; later reads must not depend on it
            start = rng.randint(0, len(expected) + 2)
            assert text.tail(start) == expected[start:]
            assert len(text) == len(expected)
        assert str(text) == expected
