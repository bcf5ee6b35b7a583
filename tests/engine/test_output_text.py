from __future__ import annotations

import random

from mlaserve.engine.output_text import OutputText


def test_matches_a_string_under_random_appends_tails_and_truncations() -> None:
    """Long enough texts that older text moves out of the tail, and reads and cuts both near
    the end (stop strings, streaming) and anywhere."""
    rng = random.Random(0)
    for _ in range(100):
        text, expected = OutputText(), ""
        for _ in range(rng.randint(0, 600)):
            op = rng.random()
            if op < 0.85:
                delta = "".join(rng.choice("ab你🙂") for _ in range(rng.randint(0, 12)))
                text.append(delta)
                expected += delta
            elif op < 0.9:
                near_end = rng.random() < 0.7
                cut = len(expected) - rng.randint(0, 20) if near_end else rng.randint(0, 3000)
                text.truncate(max(cut, 0))
                expected = expected[: max(cut, 0)]
            elif op < 0.92:
                str(text)  # joins the older text; later reads must not depend on it
            near_end = rng.random() < 0.9
            start = max(len(expected) - rng.randint(0, 30), 0) if near_end else rng.randint(0, 3000)
            assert text.tail(start) == expected[start:]
            assert len(text) == len(expected)
        assert str(text) == expected
