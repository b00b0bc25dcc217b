"""Benchmark workloads: deterministic, the right shape, and W3's noise is whitespace only."""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.workloads import (
    EDIT_KINDS,
    WORKLOADS,
    Shape,
    apply_whitespace_edits,
    make_trace,
    shape_for,
    tenant_mix,
)
from prefixgate import CanonicalizeConfig, canonicalize_text
from prefixgate.testing import ByteTokenizer

PROSE = CanonicalizeConfig.named("prose")  # the rule set that undoes all of W3's noise

TOKENIZER_JSON = Path(__file__).parent / "fixtures" / "tiny-llama" / "tokenizer.json"


class TinyLlamaTokenizer:
    """The tiny Llama's tokenizer through ``tokenizers`` (no transformers import: fast)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(TOKENIZER_JSON))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


@pytest.fixture(scope="module")
def tiny_llama() -> TinyLlamaTokenizer:
    return TinyLlamaTokenizer()


def non_ws(text: str) -> str:
    return re.sub(r"\s+", "", text)


def shared_part(prompt: str) -> str:
    return prompt.rsplit("\n\nQuestion: ", 1)[0]


@pytest.mark.parametrize("workload", [w for w in WORKLOADS])
def test_same_seed_same_trace_other_seed_other_trace(workload):
    a = make_trace(workload, "cpu", seed=3)
    b = make_trace(workload, "cpu", seed=3)
    c = make_trace(workload, "cpu", seed=4)
    assert a.requests == b.requests and a.params == b.params
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]


def test_w1_has_groups_of_equal_size_sharing_one_prefix_each():
    trace = make_trace("W1", "cpu", seed=0)
    shape = shape_for("W1", "cpu")
    assert len(trace.requests) == shape.groups * shape.per_group == 64
    assert Counter(r.group for r in trace.requests) == {g: shape.per_group for g in range(shape.groups)}
    prefixes = {r.group: shared_part(r.prompt) for r in trace.requests}
    assert all(shared_part(r.prompt) == prefixes[r.group] for r in trace.requests)
    assert len(set(prefixes.values())) == shape.groups
    assert len({r.prompt for r in trace.requests}) == len(trace.requests)  # unique questions
    assert [r.group for r in trace.requests] != sorted(r.group for r in trace.requests)  # shuffled
    assert all(r.arrival == 0.0 and r.max_tokens == shape.max_tokens and r.tenant is None
               for r in trace.requests)
    assert trace.arrivals.kind == "burst" and trace.kv_cap_tokens is None


def test_lengths_are_measured_with_the_given_tokenizer(tiny_llama):
    trace = make_trace("W1", "cpu", seed=0, tokenizer=tiny_llama)
    shape = trace.shape
    for r in trace.requests[:8]:
        prefix = len(tiny_llama.encode(shared_part(r.prompt), add_special_tokens=False))
        assert shape.prefix_tokens - 2 <= prefix <= shape.prefix_tokens
        total = len(tiny_llama.encode(r.prompt))
        assert abs(total - (shape.prefix_tokens + shape.suffix_tokens)) <= 4
    byte_trace = make_trace("W1", "cpu", seed=0, tokenizer=ByteTokenizer())
    assert len(shared_part(byte_trace.requests[0].prompt).encode()) <= shape.prefix_tokens


def test_w2_arrives_in_tile_order_with_kv_for_about_half_the_documents():
    trace = make_trace("W2", "cpu", seed=0)
    shape = trace.shape
    assert [r.group for r in trace.requests] == list(range(shape.groups)) * shape.per_group
    assert trace.kv_cap_tokens is not None
    docs_that_fit = trace.kv_cap_tokens / shape.prefix_tokens
    assert 0.4 * shape.groups <= docs_that_fit <= 0.6 * shape.groups
    gpu = shape_for("W2", "gpu")
    assert (gpu.groups, gpu.per_group, gpu.prefix_tokens) == (32, 6, 4096)


def test_best_order_puts_each_group_together_leader_first():
    trace = make_trace("W2", "cpu", seed=0)
    best = trace.best_order()
    assert sorted(map(id, best)) == sorted(map(id, trace.requests))
    groups = [r.group for r in best]
    assert groups == sorted(groups)  # tile order: groups first arrive in order 0, 1, 2, …
    leader = {}
    for r in trace.requests:
        leader.setdefault(r.group, r)
    firsts = [best[i] for i in range(len(best)) if i == 0 or best[i - 1].group != best[i].group]
    assert firsts == [leader[g] for g in range(trace.shape.groups)]


@pytest.mark.parametrize(("p", "noisy"), [(0.0, "none"), (0.5, "some"), (1.0, "all")])
def test_w3_noise_probability(p, noisy):
    trace = make_trace("W3", "cpu", seed=1, overrides={"noise_p": p})
    changed = sum(r.prompt != r.clean_prompt for r in trace.requests)
    n = len(trace.requests)
    assert {"none": changed == 0, "some": 0 < changed < n, "all": changed == n}[noisy]
    assert trace.params["noisy_requests"] == changed


def test_w3_edits_touch_only_whitespace_inside_the_shared_part():
    trace = make_trace("W3", "cpu", seed=2, overrides={"noise_p": 1.0}, tokenizer=TinyLlamaTokenizer())
    for r in trace.requests:
        assert r.prompt != r.clean_prompt
        assert non_ws(r.prompt) == non_ws(r.clean_prompt)
        question = r.clean_prompt.rsplit("\n\nQuestion: ", 1)[1]
        assert r.prompt.endswith("\n\nQuestion: " + question)  # the unique part is untouched
        assert canonicalize_text(r.clean_prompt).changed is False  # clean text is canonical
        assert canonicalize_text(r.prompt, PROSE).value == r.clean_prompt  # and prose undoes the noise


def test_w3_text_mixes_prose_code_and_json():
    trace = make_trace("W3", "cpu", seed=0)
    text = "\n".join({shared_part(r.clean_prompt) for r in trace.requests})
    assert "def " in text or "class " in text or "for " in text
    assert '": ' in text and "{" in text
    assert ". " in text


def test_whitespace_edits_are_undone_by_prose_canonicalization():
    """W3's noise includes tabs and Markdown hard breaks, which the safe default keeps."""
    base = make_trace("W3", "cpu", seed=0).requests[0].clean_prompt
    seen = set()
    for seed in range(300):
        rng = random.Random(seed)
        edited = apply_whitespace_edits(base, rng, 3)
        assert edited != base
        assert non_ws(edited) == non_ws(base)
        assert canonicalize_text(edited, PROSE).value == base
        seen.add(("\r\n" in edited, "\t" in edited, "  \n" in edited or " \n" in edited,
                  "\n\n\n" in edited, re.search(r"\S  \S", edited) is not None))
    # every kind of edit shows up: CRLF, tab, trailing spaces, blank line, doubled space
    assert all(any(flags[k] for flags in seen) for k in range(len(EDIT_KINDS)))


def test_whitespace_edits_without_a_place_leave_text_alone():
    assert apply_whitespace_edits("word", random.Random(0), 3) == "word"


def test_w4_waits_for_a_measured_rate_then_arrives_as_poisson():
    trace = make_trace("W4", "cpu", seed=0)
    assert trace.arrivals.kind == "poisson" and trace.arrivals.pending
    assert trace.arrivals.capacity_multiple == 2.0
    assert all(r.arrival == 0.0 for r in trace.requests)
    timed = trace.with_rate(10.0)
    times = [r.arrival for r in timed.requests]
    assert times == sorted(times) and times[0] > 0
    assert 0.5 / 10.0 < times[-1] / len(times) < 2.0 / 10.0
    assert timed.with_rate(10.0).requests == timed.requests
    assert not timed.arrivals.pending and timed.params["rate"] == 10.0
    gpu = shape_for("W4", "gpu")
    assert (gpu.groups, gpu.per_group, gpu.prefix_tokens, gpu.max_tokens) == (8, 32, 8192, 512)


def test_w5_is_zipf_skewed_and_for_several_replicas():
    trace = make_trace("W5", "cpu", seed=0)
    counts = Counter(r.group for r in trace.requests)
    assert trace.shape.replicas >= 2
    assert counts.most_common(1)[0][1] > 2 * trace.shape.per_group
    even = make_trace("W5", "cpu", seed=0, overrides={"popularity": "even"})
    assert set(Counter(r.group for r in even.requests).values()) == {even.shape.per_group}


def test_w0_has_a_prefill_phase_and_a_decode_phase():
    trace = make_trace("W0", "cpu", seed=0)
    shape = trace.shape
    long = [r for r in trace.requests if r.max_tokens == 1]
    short = [r for r in trace.requests if r.max_tokens > 1]
    assert len(long) == shape.calib_prompts and len(short) == shape.calib_short_prompts
    assert len({r.group for r in trace.requests}) == len(trace.requests)  # nothing shared
    assert trace.subset(lambda r: r.max_tokens == 1, "prefill").requests == tuple(long)


def test_overrides_parse_strings_and_refuse_unknown_fields():
    shape = shape_for("W1", "cpu", {"noise_p": "0.5", "arrival": "closed", "concurrency": "4",
                                    "kv_cap_tokens": "none"})
    assert (shape.noise_p, shape.arrival, shape.concurrency, shape.kv_cap_tokens) == (0.5, "closed", 4, None)
    assert shape.arrivals().kind == "closed"
    with pytest.raises(ValueError, match="unknown workload parameter"):
        shape_for("W1", "cpu", {"colour": "blue"})
    with pytest.raises(ValueError, match="integer"):
        shape_for("W1", "cpu", {"groups": "2.5"})
    with pytest.raises(ValueError, match="concurrency"):
        Shape(arrival="closed")
    with pytest.raises(ValueError, match="unknown workload"):
        make_trace("W9")
    with pytest.raises(ValueError, match="unknown size"):
        make_trace("W1", "tpu")


def test_closed_loop_and_poisson_overrides_make_valid_traces():
    closed = make_trace("W1", "cpu", overrides={"arrival": "closed", "concurrency": 3})
    assert closed.arrivals.concurrency == 3 and all(r.arrival == 0 for r in closed.requests)
    poisson = make_trace("W1", "cpu", overrides={"arrival": "poisson", "rate": 5.0})
    assert poisson.arrivals.rate == 5.0 and poisson.requests[-1].arrival > poisson.requests[0].arrival


def test_w6_mixes_cold_unique_prompts_into_hot_groups():
    trace = make_trace("W6", "cpu", seed=0)
    shape = trace.shape
    cold = [r for r in trace.requests if r.cold]
    hot = [r for r in trace.requests if not r.cold]
    assert len(cold) == shape.cold_requests == trace.params["cold"] == 16
    assert len(hot) == shape.groups * shape.per_group
    assert sorted(r.group for r in cold) == list(range(shape.groups, shape.groups + len(cold)))
    assert len({shared_part(r.prompt) for r in cold}) == len(cold)  # nothing shared among cold ones
    hot_parts = {shared_part(r.prompt) for r in hot}
    assert len(hot_parts) == shape.groups and not hot_parts & {shared_part(r.prompt) for r in cold}
    positions = [i for i, r in enumerate(trace.requests) if r.cold]
    assert positions[0] < len(trace.requests) // 2 < positions[-1]  # spread through the order
    assert trace.arrivals.pending and trace.arrivals.capacity_multiple == 0.9


def test_tenant_mix_merges_poisson_streams_at_their_own_rates():
    a = make_trace("W1", "cpu", seed=1, overrides={"per_group": 40})
    b = make_trace("W1", "cpu", seed=2, overrides={"per_group": 40})
    mix = tenant_mix([("slow", a, 2.0), ("fast", b, 20.0)], duration=10.0)
    times = [r.arrival for r in mix.requests]
    assert times == sorted(times) and times[-1] < 10.0
    count = Counter(r.tenant for r in mix.requests)
    assert 10 <= count["slow"] <= 35 and 150 <= count["fast"] <= 260
    assert mix.params["tenants"]["fast"]["requests"] == count["fast"]
    assert mix.arrivals.kind == "poisson" and mix.arrivals.rate == 22.0
    assert {r.prompt for r in mix.requests if r.tenant == "slow"} <= {r.prompt for r in a.requests}
    assert tenant_mix([("slow", a, 2.0), ("fast", b, 20.0)], duration=10.0).requests == mix.requests
    with pytest.raises(ValueError, match="do not last"):
        tenant_mix([("fast", b, 20.0)], duration=60.0)
