"""Block keys: chained, full blocks only, namespaced, and extendable without rehashing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixgate import Namespace, block_hashes
from prefixgate.keys import cacheable_blocks

NS = Namespace("m")


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(7)), 4, NS)) == 1
    assert len(block_hashes(list(range(8)), 4, NS)) == 2
    assert block_hashes([1, 2, 3], 4, NS) == ()


def test_a_change_in_block_i_changes_every_key_from_i_on():
    a = block_hashes(list(range(12)), 4, NS)
    b = block_hashes([*range(5), 99, *range(6, 12)], 4, NS)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]


def test_namespace_and_seed_separate_identical_tokens():
    ids = list(range(8))
    keys = {block_hashes(ids, 4, ns, seed=s)[0]
            for ns in (NS, Namespace("m", lora="l"), Namespace("m", tenant="t"), Namespace("n"))
            for s in (0, 1)}
    assert len(keys) == 8


def test_extending_a_chain_equals_hashing_the_whole():
    ids = list(range(20))
    head = block_hashes(ids[:9], 4, NS)
    assert block_hashes(ids, 4, NS, known=head) == block_hashes(ids, 4, NS)


@pytest.mark.parametrize(("n", "b", "expected"), [(0, 4, 0), (1, 4, 0), (4, 4, 0), (5, 4, 1),
                                                  (8, 4, 1), (9, 4, 2), (271, 128, 2)])
def test_cacheable_blocks_leave_the_last_token_to_compute(n, b, expected):
    assert cacheable_blocks(n, b) == expected


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], 0, NS)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([-1, 2, 3, 4], 4, NS)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=64), st.lists(st.integers(0, 2**32 - 1),
                                                                   max_size=64))
def test_shared_full_blocks_iff_shared_tokens(a, b):
    ha, hb = block_hashes(a, 4, NS), block_hashes(b, 4, NS)
    shared = sum(1 for x, y in zip(ha, hb, strict=False) if x == y)
    lcp = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert shared == min(lcp // 4, len(ha), len(hb))
