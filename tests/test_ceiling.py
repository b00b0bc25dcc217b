"""The prefix-cache ceiling on hand-made traces, against brute force, and κ."""

from __future__ import annotations

import random

import numpy as np
import pytest

from benchmarks.ceiling import Ceiling, best_hit_tokens, ceiling, kappa

A = list(range(1, 11))                      # 10 tokens
B = [*range(1, 9), 99, 100]                 # shares 8 tokens with A
C = list(range(1, 11))                      # A again: the last token is always recomputed
D = [1, 2, 3]                               # shares 3 with A, but may hit at most L-1 = 2
E = [5, 6, 7, 8, 9]                         # shares nothing
F = list(range(1, 14))                      # shares 10 with A/C (not with the previous, E)
G = [*range(1, 14), 20, 21]                 # shares 13 with F


def test_hand_made_trace_block_4():
    c = ceiling([A, B, C, D, E, F, G], 4)
    # A: first, nothing. B: LCP 8 -> 2 blocks. C: LCP 10 capped at 9 -> 2 blocks.
    # D: LCP 3 capped at 2 -> 0. E: 0. F: LCP 10 with A -> 2 blocks. G: LCP 13 -> 3 blocks.
    assert c.per_request == (0, 8, 8, 0, 0, 8, 12)
    assert c.prompt_tokens == 10 + 10 + 10 + 3 + 5 + 13 + 15 == 66
    assert c.hit_tokens == 36
    assert c.min_prefill_tokens == 30
    assert c.hit_rate == pytest.approx(36 / 66)
    assert c.as_dict() == {"hit_rate": 36 / 66, "min_prefill_tokens": 30, "hit_tokens": 36,
                           "prompt_tokens": 66, "block_size": 4}


def test_block_size_one_is_the_capped_lcp():
    assert best_hit_tokens([A, B, C, D, E, F, G], 1) == [0, 8, 9, 2, 0, 10, 13]


def test_only_whole_blocks_count():
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    second = [1, 2, 3, 4, 5, 6, 7, 0, 0]   # LCP 7: one whole block of 4, not two
    assert best_hit_tokens([first, second], 4) == [0, 4]
    assert best_hit_tokens([first, second], 8) == [0, 0]


def test_namespaces_do_not_share():
    assert best_hit_tokens([A, A, A], 4, namespaces=["t1", "t2", "t1"]) == [0, 0, 8]
    assert best_hit_tokens([A, A], 4, namespaces=[None, None]) == [0, 8]


def test_empty_and_tiny_prompts():
    assert ceiling([], 16) == Ceiling(16, 0, 0, ())
    assert ceiling([], 16).hit_rate == 0.0
    assert best_hit_tokens([[], [1], [1]], 1) == [0, 0, 0]
    with pytest.raises(ValueError, match="block_size"):
        best_hit_tokens([A], 0)


def test_numpy_arrays_give_the_same_answer():
    prompts = [A, B, C, D, E, F, G]
    assert ceiling([np.array(p) for p in prompts], 4) == ceiling(prompts, 4)


def brute_force(prompts: list[list[int]], b: int) -> list[int]:
    out = []
    for i, p in enumerate(prompts):
        lcp = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            lcp = max(lcp, n)
        out.append(b * (min(lcp, len(p) - 1) // b) if p else 0)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_on_random_traces(seed):
    rng = random.Random(seed)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    prompts = []
    for _ in range(30):
        stem = rng.choice(stems)
        cut = rng.randrange(len(stem) + 1)
        prompts.append(stem[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))])
    for b in (1, 2, 3, 4, 16):
        assert best_hit_tokens(prompts, b) == brute_force(prompts, b)


def test_kappa():
    assert kappa(100, 40, 20) == pytest.approx(0.75)
    assert kappa(100, 20, 20) == 1.0
    assert kappa(100, 100, 20) == 0.0
    assert kappa(100, 120, 20) == pytest.approx(-0.25)
    # nothing avoidable: 1 if L is at the minimum too, else undefined
    assert kappa(20, 20, 20) == 1.0
    assert kappa(20, 30, 20) is None
