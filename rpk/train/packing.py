"""Which samples go into which forward/backward pass, as pure arithmetic over lengths.

One process packs its samples into micro-batches of bounded padded size. Several
data-parallel ranks first share a chunk out, balanced by tokens, and then every rank must
run the same number of passes (each FSDP pass all-gathers the weights, with every rank
taking part): a rank with fewer pads with empty micro-batches, which the trainer runs as
a pass whose loss counts zero.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedily pack sequences (indices into `lengths`) into micro-batches whose padded
    size, rows x longest row, stays within `budget` tokens.

    Longest first, so each micro-batch's first member fixes its padded width and the
    rows that follow are close to it in length (little padding). A sequence longer than
    the budget on its own gets a micro-batch of its own rather than being dropped.
    """
    if budget <= 0:
        raise ValueError(f"micro-batch token budget must be > 0, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    width = 0
    for i in order:
        if batches and (len(batches[-1]) + 1) * width <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
            width = lengths[i]
    return batches


def split_across(lengths: Sequence[int], ranks: int, budget: int) -> list[list[list[int]]]:
    """For each rank, its micro-batches (lists of indices into `lengths`), every rank
    with the same number of them (the short ones padded with empty micro-batches).

    Longest first, each sample to the rank with the fewest tokens so far (LPT): the
    ranks' forward/backward work comes out nearly even."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    load = [0] * ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owned[r].append(i)
        load[r] += lengths[i]
    per_rank = [
        [[mine[k] for k in batch] for batch in pack_micro_batches([lengths[i] for i in mine], budget)]
        for mine in owned
    ]
    passes = max(len(batches) for batches in per_rank)
    return [batches + [[] for _ in range(passes - len(batches))] for batches in per_rank]
