"""The proposer's draft texts and matching (`rpk.sync.worker.spec_index`), alone: rows as
vLLM hands them (token ids, prompt and output together), drafts out."""

from __future__ import annotations

import numpy as np
import pytest

from rpk.core.drafts import Draft, DraftSource, PromptDrafts
from rpk.sync.worker.spec_index import DraftIndex

WIDTH = 64
ALL = list(DraftSource)


def rows(*contexts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(contexts), WIDTH), dtype=np.int32)
    for i, c in enumerate(contexts):
        ids[i, : len(c)] = c
    return np.array([len(c) for c in contexts], dtype=np.int32), ids


def drafts(prompt: list[int], *texts: tuple[DraftSource, list[int]]) -> PromptDrafts:
    return PromptDrafts(tuple(prompt), tuple(Draft(s, tuple(t)) for s, t in texts))


P = [1, 2, 3, 4, 5]
Q = [1, 2, 3, 9, 9, 8]


def test_a_row_drafts_the_continuation_of_a_finished_sibling() -> None:
    index = DraftIndex(4)
    index.reset([(1, 64, 4)], ALL, [drafts(P, (DraftSource.SIBLING, [10, 11, 12, 13, 14, 15]))])
    n, ids = rows(P + [10, 11])
    assert index.propose([[11]], n, ids) == [[12, 13, 14, 15]]


def test_a_row_that_just_started_drafts_a_siblings_first_tokens() -> None:
    index = DraftIndex(3)
    index.reset([(1, 64, 3)], ALL, [drafts(P, (DraftSource.SIBLING, [10, 11, 12, 13]))])
    # Its context ends in the prompt plus the one token it sampled.
    n, ids = rows(P + [10])
    assert index.propose([[10]], n, ids) == [[11, 12, 13]]


def test_a_repetitive_text_drafts_from_where_a_whole_draft_follows() -> None:
    """Greedy decoding often repeats itself: every place in the text matches the row's
    last tokens, and the newest (the text's end) leaves one token; the draft comes from
    a place with k tokens after it."""
    index = DraftIndex(4)
    index.reset([(1, 64, 4)], ALL, [drafts(P, (DraftSource.SIBLING, [7] * 12))])
    n, ids = rows(P + [7, 7, 7])
    assert index.propose([[7]], n, ids) == [[7, 7, 7, 7]]


def test_rows_are_matched_to_their_own_prompt_only() -> None:
    index = DraftIndex(4)
    index.reset([(1, 64, 4)], ALL, [
        drafts(P, (DraftSource.SIBLING, [20, 21, 22, 23])),
        drafts(Q, (DraftSource.SIBLING, [20, 21, 30, 31])),
    ])
    n, ids = rows(P + [20, 21], Q + [20, 21], [7, 7, 7, 20, 21])
    assert index.propose([[21], [21], [21]], n, ids) == [[22, 23], [30, 31], []]


def test_the_longest_prompt_a_row_starts_with_is_its_prompt() -> None:
    """A trajectory's next turn starts with its prompt and its earlier turns."""
    short, turn = [1, 2, 3], [1, 2, 3, 40, 41, 42]
    index = DraftIndex(2)
    index.reset([(1, 64, 2)], ALL, [
        drafts(short, (DraftSource.SIBLING, [50, 51, 52, 53])),
        drafts(turn, (DraftSource.SIBLING, [50, 51, 60, 61])),
    ])
    n, ids = rows(turn + [50, 51])
    assert index.propose([[51]], n, ids) == [[60, 61]]


def test_a_longer_match_beats_a_shorter_and_a_confident_one_goes_by_source_rank() -> None:
    index = DraftIndex(2, min_match=2, confident=3)
    # Both texts contain "7 8"; only the epoch text also has the 9 before it.
    index.reset([(1, 64, 2)], ALL, [drafts(P, (DraftSource.SIBLING, [7, 8, 30, 31]),
                                           (DraftSource.EPOCH, [9, 7, 8, 40, 41]))])
    n, ids = rows(P + [9, 7, 8])
    assert index.propose([[8]], n, ids) == [[40, 41]]
    # With three tokens matched in both, the sibling (ranked first) wins.
    index.reset([(1, 64, 2)], ALL, [drafts(P, (DraftSource.EPOCH, [9, 7, 8, 40, 41]),
                                           (DraftSource.SIBLING, [6, 9, 7, 8, 30, 31]))])
    n, ids = rows(P + [6, 9, 7, 8])
    assert index.propose([[8]], n, ids) == [[30, 31]]


def test_the_prompt_source_looks_up_the_prompts_own_ngrams() -> None:
    prompt = [1, 2, 30, 31, 32, 33, 9]
    index = DraftIndex(3)
    index.reset([(1, 64, 3)], [DraftSource.PROMPT], [drafts(prompt)])
    n, ids = rows(prompt + [30, 31])
    assert index.propose([[31]], n, ids) == [[32, 33, 9]]


def test_the_prompts_own_ngrams_draft_only_beside_a_response_text() -> None:
    prompt = [1, 2, 30, 31, 32, 33, 9]
    index = DraftIndex(3)
    index.reset([(1, 64, 3)], ALL, [drafts(prompt)])
    n, ids = rows(prompt + [30, 31])
    assert index.propose([[31]], n, ids) == [[]]  # its n-grams alone: no draft
    index.add(drafts(prompt, (DraftSource.SIBLING, [40, 41, 42])))
    assert index.propose([[31]], n, ids) == [[32, 33, 9]]  # beside a sibling: the fallback


def test_sources_not_chosen_are_not_indexed() -> None:
    index = DraftIndex(3)
    index.reset([(1, 64, 3)], [DraftSource.PARTIAL],
                [drafts(P, (DraftSource.SIBLING, [10, 11, 12, 13]), (DraftSource.PARTIAL, [10, 11, 14]))])
    n, ids = rows(P + [10, 11])
    assert index.propose([[11]], n, ids) == [[14]]


def test_the_draft_length_follows_the_batch_and_zero_drafts_nothing() -> None:
    index = DraftIndex(4)
    index.reset([(1, 1, 4), (2, 2, 1), (3, 64, 0)], ALL,
                [drafts(P, (DraftSource.SIBLING, [10, 11, 12, 13, 14, 15]))])
    one = rows(P + [10, 11])
    assert index.propose([[11]], *one) == [[12, 13, 14, 15]]
    two = rows(P + [10, 11], P + [10, 11])
    assert index.propose([[11], [11]], *two) == [[12], [12]]
    three = rows(P + [10, 11], P + [10, 11], P + [10, 11])
    assert index.propose([[11], [11], [11]], *three) == [[], [], []]
    # Rows that do not decode this step (a prefill chunk) neither draft nor count.
    assert index.propose([[11], [], []], *three) == [[12, 13, 14, 15], [], []]


def test_a_draft_never_runs_past_the_row_width() -> None:
    index = DraftIndex(8)
    long = list(range(100, 100 + WIDTH))
    index.reset([(1, 64, 8)], ALL, [drafts(P, (DraftSource.SIBLING, long))])
    context = P + long[: WIDTH - len(P) - 3]
    n, ids = rows(context)
    got = index.propose([[context[-1]]], n, ids)
    assert len(got[0]) == 2  # width - n - 1 tokens fit


def test_accepted_tokens_are_counted_per_source_at_the_rows_next_step() -> None:
    index = DraftIndex(4)
    index.reset([(1, 64, 4)], ALL, [drafts(P, (DraftSource.SIBLING, [10, 11, 12, 13, 14, 15, 16, 17]))])
    ctx = P + [10, 11]
    n, ids = rows(ctx)
    assert index.propose([[11]], n, ids) == [[12, 13, 14, 15]]
    # Two drafts accepted, then the bonus token (not the third draft): 3 tokens gained.
    ctx = ctx + [12, 13, 99]
    n, ids = rows(ctx)
    assert index.propose([[12, 13, 99]], n, ids) == [[]]
    counts = index.take_counts()
    assert counts[DraftSource.SIBLING].drafts == 1
    assert counts[DraftSource.SIBLING].tokens == 4
    assert counts[DraftSource.SIBLING].accepted == 2
    assert index.take_counts() == {}


def test_a_slot_taken_by_another_request_is_mapped_afresh_and_not_scored() -> None:
    index = DraftIndex(2)
    index.reset([(1, 64, 2)], ALL, [drafts(P, (DraftSource.SIBLING, [10, 11, 12, 13])),
                                     drafts(Q, (DraftSource.SIBLING, [10, 11, 20, 21]))])
    assert index.propose([[11]], *rows(P + [10, 11])) == [[12, 13]]
    # Slot 0 now holds a request of Q (the batch was condensed): its own drafts.
    assert index.propose([[11]], *rows(Q + [10, 11])) == [[20, 21]]
    assert index.take_counts()[DraftSource.SIBLING].accepted == 0


def test_siblings_added_mid_round_are_drafted_from() -> None:
    index = DraftIndex(3)
    index.reset([(1, 64, 3)], ALL, [drafts(P)])
    n, ids = rows(P + [10, 11])
    assert index.propose([[11]], n, ids) == [[]]
    index.add(drafts(P, (DraftSource.SIBLING, [10, 11, 12, 13, 14])))
    assert index.propose([[11]], *rows(P + [10, 11, 12])) == [[13, 14]]


def test_a_prompt_holds_at_most_max_texts() -> None:
    index = DraftIndex(2, max_texts=2)
    index.reset([(1, 64, 2)], ALL, [drafts(P, *[(DraftSource.SIBLING, [10 + i, 11, 12]) for i in range(5)])])
    assert index.propose([[11]], *rows(P + [14, 11])) == [[]]  # the fifth text was not kept
    assert index.propose([[11]], *rows(P + [10, 11])) == [[12]]


def test_a_bad_schedule_is_refused() -> None:
    index = DraftIndex(2)
    with pytest.raises(ValueError, match="batch size 1"):
        index.reset([(2, 64, 2)], ALL, [])


def test_the_wire_form_round_trips() -> None:
    p = drafts(P, (DraftSource.PARTIAL, [1, 2]), (DraftSource.EPOCH, [3]))
    assert PromptDrafts.from_wire(p.to_wire()) == p
