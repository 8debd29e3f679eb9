"""The pieces of sharded commits that need no processes: placement, covering, the flat
view of a state and a commit's shares reassembled bit for bit (runtime/shards.py,
runtime/flat.py, dataparallel/snapshot.py). The real runs are in test_elastic.py and
test_state.py."""
from __future__ import annotations

import random

import pytest
import torch

from elastic.dataparallel.snapshot import merged, take
from elastic.runtime.flat import Flat, tree_digest
from elastic.runtime.shards import Transfer, buddies, cover, covering_step, kept_by, shares, transfers


def test_buddies_are_a_permutation_onto_other_hosts():
    assert buddies(["a", "b", "c"]) == [1, 2, 0]
    assert buddies(["a", "a", "b", "b"]) == [2, 3, 0, 1]          # one extra piece each
    assert buddies(["a", "b", "a", "b"]) == [1, 0, 3, 2]
    assert buddies(["a", "a"]) == [1, 0]                          # one host: the next rank
    assert buddies(["a"]) == [0]
    for hosts in (list("aabbcc"), list("abcabc"), list("aaabbc"), list("abcd")):
        b = buddies(hosts)
        assert sorted(b) == list(range(len(hosts)))
        assert all(hosts[r] != hosts[b[r]] for r in range(len(hosts))), hosts
    assert kept_by([1, 2, 0], 1) == [1, 0] and kept_by([0], 0) == [0]


def test_shares_cut_the_bytes_into_aligned_pieces():
    assert shares(1000, 3) == [(0, 384), (384, 768), (768, 1000)]
    assert shares(10, 4) == [(0, 10), (10, 10), (10, 10), (10, 10)]
    assert shares(0, 2) == [(0, 0), (0, 0)]


def held(rank, step, *ranges, extent=12):
    return {"rank": rank, "step": step, "extent": extent, "ranges": list(ranges)}


def test_cover_uses_buddy_copies_and_spots_gaps():
    # 4 ranks, shares of 3 bytes; rank r keeps r and r - 1. Ranks 1 and 3 are gone:
    # shares 1 and 3 survive only as buddy copies on ranks 2 and 0.
    items = [held(0, 10, (0, 3), (9, 12)), held(2, 10, (6, 9), (3, 6))]
    assert covering_step(items) == 10
    assert [(p.owner, p.start, p.end) for p in cover(items, 10)] == [(0, 0, 3), (2, 3, 6), (2, 6, 9),
                                                                     (0, 9, 12)]
    # Ranks 1 and 2 gone: share 1 (bytes 3..6) had copies only there.
    gap = [held(0, 10, (0, 3), (9, 12)), held(3, 10, (9, 12), (6, 9))]
    assert cover(gap, 10) is None and covering_step(gap) is None
    # An older commit that is whole wins over a newer one with a gap; pieces of two
    # layouts of one commit combine.
    gap.append(held(3, 5, (0, 12)))
    assert covering_step(gap) == 5
    mixed = [held(0, 7, (0, 6)), held(1, 7, (4, 12)), held(2, 7, (3, 9))]
    assert [(p.owner, p.start, p.end, p.held) for p in cover(mixed, 7)] == \
        [(0, 0, 6, (0, 6)), (1, 6, 12, (4, 12))]


def state_tree():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    return {"objects": {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "flags": torch.tensor([True, False]), "empty": torch.empty(0, 2)},
            "step": 11, "epoch": 2, "consumed": 40}


def stages_held(step: int, *ranges: tuple) -> list[dict]:
    """An inventory where rank r holds children ``ranges[r]`` of ``step`` (4 children)."""
    return [{"rank": r, "step": step, "extent": 4, "ranges": [rng] if rng else []}
            for r, rng in enumerate(ranges)]


def test_a_replan_moves_only_the_stages_whose_owners_change():
    # pp 2 x dp 2 lost its rank 1: survivors hold stage (0, 2) twice and (2, 4) once.
    # Re-cut to 3 stages, only the middle one has a part its rank lacks.
    items = stages_held(27, (0, 2), (0, 2), (2, 4))
    assert transfers(items, 27, [(0, 1), (1, 3), (3, 4)]) == [Transfer(receiver=1, owner=2, held=(2, 4))]
    # The same grid again: nothing moves at all.
    assert transfers(items, 27, [(0, 2), (0, 2), (2, 4)]) == []
    # A commit of another step is not used for this one.
    older = items + stages_held(25, (2, 4), (2, 4), (0, 2))
    assert transfers(older, 27, [(0, 2), (0, 2), (2, 4)]) == []


def test_newcomers_receive_each_stage_from_its_replicas_in_turn():
    # pp 2 x dp 2 grows to dp 4: the two new replicas of each stage are served by the two
    # ranks holding it, not both by the same one; the old ranks receive nothing.
    items = stages_held(9, (0, 2), (2, 4), (0, 2), (2, 4), (), (), (), ())
    needs = [(0, 2), (2, 4)] * 4
    moves = transfers(items, 9, needs)
    assert {m.receiver for m in moves} == {4, 5, 6, 7}
    assert sorted((m.receiver, m.owner, m.held) for m in moves) == \
        [(4, 0, (0, 2)), (5, 1, (2, 4)), (6, 2, (0, 2)), (7, 3, (2, 4))]
    # A rank needing two stages' children receives both pieces.
    assert transfers(stages_held(9, (0, 2), (2, 4), ()), 9, [(0, 2), (2, 4), (0, 4)]) == \
        [Transfer(2, 0, (0, 2)), Transfer(2, 1, (2, 4))]


def test_flat_ranges_round_trip_bit_for_bit():
    tree = state_tree()
    flat = Flat.of(tree)
    assert flat.total == sum(t.numel() * t.element_size() for t in flat.tensors)
    rng = random.Random(0)
    for _ in range(30):      # arbitrary cuts, across tensor boundaries
        cuts = sorted({0, flat.total, *(rng.randrange(flat.total) for _ in range(rng.randrange(1, 6)))})
        fresh = Flat.empty(flat.skeleton)
        for start, end in zip(cuts, cuts[1:]):
            fresh.write(start, flat.read(start, end, torch.empty(end - start, dtype=torch.uint8)))
        assert tree_digest(fresh.tree()) == tree_digest(tree)
    fresh.tensors[0].view(-1)[0] += 1
    assert tree_digest(fresh.tree()) != tree_digest(tree)


def test_views_of_a_range_are_the_tensors_own_bytes_at_their_offsets():
    """What a transfer broadcasts in place: slices cut at tensor boundaries, each one a
    view (writing it writes the tensor), covering the range exactly."""
    tree = state_tree()
    flat, fresh = Flat.of(tree), Flat.empty(Flat.of(tree).skeleton)
    rng = random.Random(1)
    for _ in range(30):
        start = rng.randrange(flat.total)
        end = rng.randrange(start + 1, flat.total + 1)
        views = flat.views(start, end)
        assert views[0][0] == start and sum(v.numel() for _, v in views) == end - start
        assert all(a + v.numel() == b for (a, v), (b, _) in zip(views, views[1:]))
        expected = flat.read(start, end, torch.empty(end - start, dtype=torch.uint8))
        assert torch.equal(torch.cat([v for _, v in views]), expected)
    for (offset, theirs), (_, mine) in zip(flat.views(0, flat.total), fresh.views(0, flat.total)):
        mine.copy_(theirs)
    assert tree_digest(fresh.tree()) == tree_digest(tree)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_any_covering_set_of_commit_shares_rebuilds_the_state(size):
    tree = state_tree()
    flat = Flat.of(tree)
    ring = buddies([f"h{r}" for r in range(size)])
    pieces = shares(flat.total, size)
    commits = {r: take(flat, 11, [pieces[k] for k in kept_by(ring, r)], None) for r in range(size)}
    assert all(c.held_bytes <= 2 * -(-flat.total // size) + 128 for c in commits.values())
    lost = {1, 3} if size == 4 else {1}     # two at once where every share still has a copy
    items = [{"rank": r, **c.summary()} for r, c in commits.items() if r not in lost]
    parts = cover(items, 11)
    rebuilt = Flat.empty(commits[0].skeleton)
    for part in parts:
        rebuilt.write(part.start, commits[part.owner].piece(part.held, part.start, part.end))
    assert tree_digest(rebuilt.tree()) == tree_digest(tree)
    # Committing again into the same buffers: written in place, the new values inside.
    tree["objects"]["model"]["0.weight"].add_(1)
    again = take(Flat.of(tree), 12, list(commits[0].held), commits[0])
    assert all(again.held[r].data_ptr() == commits[0].held[r].data_ptr() for r in again.held)


def test_a_commit_placed_for_a_new_world_reuses_the_old_commits_memory():
    """3 ranks -> 2: a rank that held two thirds now holds all of it. The new ranges are
    carved out of the old buffers (fresh memory costs its page faults, several times the
    copy) and only the missing third is allocated; every byte is the new state's; back at
    3 ranks, nothing is allocated at all."""
    tree = state_tree()
    flat = Flat.of(tree)
    old = take(flat, 5, [shares(flat.total, 3)[k] for k in (0, 1)], None)
    storages = {b.untyped_storage().data_ptr() for b in old.held.values()}
    tree["objects"]["model"]["0.weight"].add_(1)
    flat = Flat.of(tree)
    two = shares(flat.total, 2)
    new = take(flat, 6, two, old)
    assert merged(new.held) == [(0, flat.total)] and new.held_bytes == flat.total
    reused = [b for b in new.held.values() if b.untyped_storage().data_ptr() in storages]
    assert sum(b.numel() for b in reused) == old.held_bytes    # all of it, none wasted
    for (start, end), buffer in new.held.items():
        assert torch.equal(buffer, flat.read(start, end, torch.empty(end - start, dtype=torch.uint8)))
    parts = cover([{"rank": 0, **new.summary()}], 6)
    rebuilt = Flat.empty(new.skeleton)
    for part in parts:
        rebuilt.write(part.start, new.piece(part.held, part.start, part.end))
    assert tree_digest(rebuilt.tree()) == tree_digest(tree)
    back = take(flat, 7, [shares(flat.total, 3)[k] for k in (0, 1)], new)
    grown = {b.untyped_storage().data_ptr() for b in new.held.values()}
    assert all(b.untyped_storage().data_ptr() in grown for b in back.held.values())
    assert merged(back.held) == [(0, shares(flat.total, 3)[1][1])]


def test_a_survivor_receives_straight_into_its_live_tensors():
    tree = state_tree()
    source = Flat.of(tree)
    torch.manual_seed(4)     # another replica of the same shapes, other values
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    assert Flat.of({"objects": {"model": model.state_dict(), "optimizer": optimizer.state_dict()}}) \
        .into(source.skeleton) is None          # no Adam moments yet: a new worker's layout
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    live = {"objects": {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "flags": torch.tensor([False, True]), "empty": torch.empty(0, 2)},
            "step": 3, "epoch": 0, "consumed": 8}
    target = Flat.of(live).into(source.skeleton)
    weight = model[0].weight
    target.write(0, source.read(0, source.total, torch.empty(source.total, dtype=torch.uint8)))
    restored = target.tree()
    model.load_state_dict(restored["objects"]["model"])
    optimizer.load_state_dict(restored["objects"]["optimizer"])
    assert model[0].weight is weight and torch.equal(weight, tree["objects"]["model"]["0.weight"])
    assert tree_digest({"model": model.state_dict(), "optimizer": optimizer.state_dict()}) == \
        tree_digest({k: tree["objects"][k] for k in ("model", "optimizer")})
    assert restored["step"] == 11


def test_a_commit_handed_over_in_a_file_comes_back_identical(tmp_path):
    """A worker replaced in place leaves its shares to its successor in a file that loads
    with weights_only (slots as plain tuples)."""
    import torch
    from elastic.dataparallel import snapshot
    from elastic.runtime.flat import Flat
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    flat = Flat.of({"objects": {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                    "step": 5, "epoch": 1, "consumed": 7})
    commit = snapshot.take(flat, 5, [(0, 64), (64, flat.total)], None)
    snapshot.save_commit(commit, tmp_path / "handoff.pt")
    back = snapshot.load_commit(tmp_path / "handoff.pt")
    assert (back.step, back.total, back.skeleton) == (5, flat.total, commit.skeleton)
    assert list(back.held) == [(0, 64), (64, flat.total)]
    assert all(torch.equal(back.held[key], commit.held[key]) for key in commit.held)
