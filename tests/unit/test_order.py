"""The epoch plan's invariant, for any units, grids and stopping points: every sample is read
exactly once per epoch across ranks × streams, also when a run stops mid-epoch and continues
on another grid (several times)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from torchkeel.data.order import Position, Unit, continue_position, merge_positions, plan_streams

grids = st.tuples(st.integers(1, 4), st.integers(1, 4))  # (world_size, streams per rank)


def read(units, position, streams, taken_per_stream):
    """Each stream reads its first ``taken`` samples; returns them and the ranks' positions."""
    seen = []
    per_rank = position.streams
    rank_positions = [
        Position(
            position.epoch,
            position.world_size,
            position.streams,
            list(position.base),
            list(position.consumed),
            list(position.next_stream),
            list(position.stream_items),
        )
        for _ in range(position.world_size)
    ]
    for s, (stream, taken) in enumerate(zip(streams, taken_per_stream)):
        mine = rank_positions[s // per_rank]
        for work in stream:
            if taken <= 0:
                break
            n = min(taken, units[work.unit].num_samples - work.first)
            seen += [(work.unit, i) for i in range(work.first, work.first + n)]
            mine.consumed[work.unit] = work.first + n
            taken -= n
    return seen, merge_positions(rank_positions)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    seed=st.integers(0, 2**31),
    segments=st.lists(st.tuples(grids, st.lists(st.integers(0, 60), min_size=16, max_size=16)), min_size=1, max_size=4),
    epoch=st.integers(0, 5),
    shuffle=st.booleans(),
)
def test_every_sample_once_per_epoch_across_segments_and_grids(sizes, seed, segments, epoch, shuffle):
    units = [Unit(f"u{i}", n) for i, n in enumerate(sizes)]
    saved, seen = None, []
    for (world_size, streams_per_rank), taken in segments:
        position = continue_position(saved, epoch, len(units), world_size, streams_per_rank)
        streams = plan_streams(units, seed, position, shuffle=shuffle)
        assert len(streams) == world_size * streams_per_rank
        got, saved = read(units, position, streams, taken)
        seen += got
    position = continue_position(saved, epoch, len(units), 1, 1)  # the rest, on one stream
    rest, _ = read(units, position, plan_streams(units, seed, position, shuffle=shuffle), [10**6])
    seen += rest
    assert sorted(seen) == sorted((u, i) for u, n in enumerate(sizes) for i in range(n))


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12), seed=st.integers(0, 2**31), grid=grids)
def test_the_plan_depends_only_on_seed_epoch_and_grid(sizes, seed, grid):
    units = [Unit(f"u{i}", n) for i, n in enumerate(sizes)]
    fresh = continue_position(None, 3, len(units), *grid)
    assert plan_streams(units, seed, fresh, shuffle=True) == plan_streams(units, seed, fresh, shuffle=True)
    loads = [sum(sizes[w.unit] for w in s) for s in plan_streams(units, seed, fresh, shuffle=True)]
    assert max(loads) - min(loads) <= max(sizes)  # greedy: streams differ by at most one unit
