"""The chunk planner (CONTRACT §4) and the plan validator (CONTRACT §7)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctxprefill.engine.plan import ContextChunk, plan_chunks, validate_plan
from ctxprefill.errors import InvalidArgument


def test_seed_case_plan():
    chunks = plan_chunks([200, 48, 32, 0], workspace_tokens=128, block_size=16)
    assert [(c.first_sequence, c.context_starts, c.context_lens) for c in chunks] == [
        (0, (0,), (128,)),
        (0, (128, 0), (72, 48)),  # continuation; seq 2 does not fit the 8 rows left
        (2, (0,), (32,)),
    ]
    assert [c.is_continuation for c in chunks] == [False, True, False]


def test_chunk_ending_exactly_on_workspace_boundary_closes():
    chunks = plan_chunks([64, 64, 10], workspace_tokens=128, block_size=16)
    assert [c.rows for c in chunks] == [128, 10]
    assert chunks[1].first_sequence == 2 and not chunks[1].is_continuation


def test_empty_sequences_inside_a_chunk_keep_rows_contiguous():
    chunks = plan_chunks([0, 5, 0, 0, 7, 0], workspace_tokens=64, block_size=16)
    assert len(chunks) == 1
    c = chunks[0]
    assert c.first_sequence == 1 and c.context_lens == (5, 0, 0, 7)


def test_no_context_no_chunks():
    assert plan_chunks([0, 0], 64, 16) == []


def test_workspace_smaller_than_a_block_is_rejected():
    with pytest.raises(InvalidArgument, match="workspace_tokens"):
        plan_chunks([10], 8, 16)


@given(
    lens=st.lists(st.integers(0, 700), min_size=0, max_size=12),
    block=st.sampled_from([1, 16, 64]),
    w_blocks=st.integers(1, 12),
    extra=st.integers(0, 15),
)
def test_plan_properties(lens, block, w_blocks, extra):
    W = w_blocks * block + (extra % block if block > 1 else 0)
    chunks = plan_chunks(lens, W, block)
    covered = [0] * len(lens)
    for c in chunks:
        assert 0 < c.rows <= W  # no empty chunk, none over the workspace
        assert c.context_lens[0] > 0  # a chunk starts with a sequence that has rows
        for k, (s, n) in enumerate(zip(c.context_starts, c.context_lens, strict=True)):
            seq = c.first_sequence + k
            if k > 0:
                assert s == 0  # only the first sequence may be a continuation
            if n:
                assert s == covered[seq]  # in order, exactly once
            else:
                assert lens[seq] == 0 or k == 0
            covered[seq] += n
            # a split happens on a block boundary
            if s + n < lens[seq]:
                assert (s + n) % block == 0
    assert covered == list(lens)
    validate_plan(chunks, lens, W)  # the planner's plans pass the validator


@pytest.mark.parametrize(
    "plan, msg",
    [
        ([ContextChunk(0, (0,), (100,))], "covers 100 of sequence 0"),
        ([ContextChunk(0, (0,), (200,))], "more than workspace_tokens"),
        ([ContextChunk(0, (0, 0), (100, 10)), ContextChunk(0, (100, 10), (80, 38))], "only a chunk's first"),
        ([ContextChunk(0, (0,), (128,)), ContextChunk(0, (0,), (72,))], "expected to continue at 128"),
        ([ContextChunk(1, (0,), (48,)), ContextChunk(0, (0,), (128,)), ContextChunk(0, (128,), (72,))], None),
        ([ContextChunk(3, (0,), (5,))], "outside the request"),
        ([ContextChunk(0, (0,), (0,))], "empty"),
    ],
)
def test_validate_plan(plan, msg):
    lens = [200, 48]
    if msg is None:
        validate_plan(plan, lens, 128)
        return
    with pytest.raises(InvalidArgument, match=msg):
        validate_plan(plan, lens, 128)


def test_a_remembered_plan_is_the_plan_and_bounded():
    """Plans of recent request shapes are remembered: the same chunks as planned afresh, a
    fresh list per call (a caller may keep or change it), and no plan kept for a request
    of more sequences, or more workspaces of context, than the limits."""
    from ctxprefill.engine import plan as plan_mod

    plan_mod._remembered_plan.cache_clear()
    lens = [200, 48, 32, 0]
    a, b = plan_chunks(lens, 128, 16), plan_chunks(lens, 128, 16)
    assert a == b == plan_mod._plan(lens, 128, 16) and a is not b
    assert plan_mod._remembered_plan.cache_info().hits == 1
    plan_chunks([16] * (plan_mod.REMEMBER_SEQUENCES + 1), 128, 16)
    plan_chunks([16 * (plan_mod.REMEMBER_WORKSPACES + 1)], 16, 16)
    assert plan_mod._remembered_plan.cache_info().currsize == 1
