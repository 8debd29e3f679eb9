"""The global-cursor sampler: across resets to any world size, within an epoch no sample
is skipped or seen twice."""
import torch

from elastic.data.sampler import Cursor, global_batch, rank_share


def test_rank_shares_partition_the_batch():
    batch = torch.arange(10)
    shares = [rank_share(batch, r, 3).tolist() for r in range(3)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [rank_share(torch.arange(2), r, 3).tolist() for r in range(3)] == [[0], [1], []]


def test_epoch_is_covered_exactly_once_across_world_size_changes():
    n, batch, seed = 1000, 64, 3
    sizes = [3, 3, 2, 2, 2, 4, 4, 1]   # world size changes every few steps
    cursor, seen = Cursor(), []
    step = 0
    while cursor.epoch == 0:
        size = sizes[step % len(sizes)]
        indices = global_batch(cursor, n, batch, seed)
        for rank in range(size):
            seen += rank_share(indices, rank, size).tolist()
        cursor = cursor.advance(len(indices), n)
        step += 1
    assert sorted(seen) == list(range(n))


def test_restore_replays_the_same_samples():
    n = 100
    committed = Cursor(0, 40)
    first = global_batch(committed, n, 16, seed=0)
    again = global_batch(committed, n, 16, seed=0)   # after a restore to the same commit
    assert torch.equal(first, again)
    assert not torch.equal(global_batch(Cursor(1, 40), n, 16, 0), first)   # new epoch, new order
