"""SuffixCache: per-row offsets, growth, rows joining and leaving."""

from __future__ import annotations

import pytest
import torch

from polykv_agents.runtime.suffix_cache import SuffixCache


def _row(length: int, value: float, capacity: int = 4) -> SuffixCache:
    cache = SuffixCache(num_layers=1, batch_size=1, capacity=capacity)
    keys = torch.full((1, 2, length, 3), value)
    cache.update(keys, keys + 100, 0)
    cache.advance(length)
    return cache


def test_rows_write_at_their_own_offsets_and_grow_past_capacity():
    batch = _row(2, 1.0)
    batch.concat(_row(6, 2.0))  # longer than the first row's capacity
    assert batch.lengths.tolist() == [2, 6]
    new = torch.stack([torch.full((2, 1, 3), 10.0), torch.full((2, 1, 3), 20.0)])  # [2, 2, 1, 3]
    keys, values = batch.update(new, new + 100, 0)
    batch.advance(1)
    assert keys.shape[-2] == 7  # longest row after the update
    assert keys[0, 0, :3, 0].tolist() == [1.0, 1.0, 10.0]
    assert keys[1, 0, :7, 0].tolist() == [2.0] * 6 + [20.0]
    assert values[1, 0, 6, 0] == 120.0


def test_select_keeps_rows_in_the_given_order():
    batch = _row(1, 1.0)
    batch.concat(_row(2, 2.0))
    batch.concat(_row(3, 3.0))
    batch.select(torch.tensor([2, 0]))
    assert batch.lengths.tolist() == [3, 1]
    assert batch.layers[0].keys[:, 0, 0, 0].tolist() == [3.0, 1.0]
    batch.select(torch.tensor([], dtype=torch.long))
    assert batch.batch_size == 0
    batch.concat(_row(2, 5.0))  # an emptied batch takes new rows
    assert batch.lengths.tolist() == [2]


def test_nbytes_counts_allocated_suffix_tensors():
    batch = _row(2, 1.0, capacity=4)
    assert batch.nbytes == 2 * 1 * 2 * 4 * 3 * 4  # keys + values, [1, 2, 4, 3] float32
    assert batch.layers[0].device == torch.device("cpu")  # where the layer's tensors live, as transformers asks


def test_a_row_that_exactly_fills_the_capacity_does_not_grow_it():
    batch = _row(4, 1.0, capacity=4)  # 4 slots written: full, not over
    assert batch.layers[0].keys.shape == (1, 2, 4, 3)
    assert batch.nbytes == 2 * 1 * 2 * 4 * 3 * 4


def test_caches_with_different_layer_counts_never_join():
    with pytest.raises(ValueError, match="zip"):
        _two_layers(2).concat(_row(1, 1.0))


def test_capacity_grows_in_steps_of_sixteen_slots_and_rows_join_at_the_wider_width():
    batch = _row(3, 1.0, capacity=16)
    assert batch.layers[0].keys.shape[-2] == 16
    batch.concat(_row(17, 2.0, capacity=16))  # that row grew to 32 slots: the batch is padded to match
    assert [layer.keys.shape for layer in batch.layers] == [torch.Size([2, 2, 32, 3])]
    assert batch.layers[0].values.shape == (2, 2, 32, 3)
    assert batch.layers[0].keys[0, 0, 3:, 0].eq(0).all()  # padding, never attended to
    assert batch.layers[0].values[1, 0, :17, 0].eq(102.0).all()


def test_sizes_reported_to_the_model_follow_the_longest_row():
    batch = SuffixCache(num_layers=2, batch_size=0)
    layer = batch.layers[0]
    assert (layer.get_seq_length(), layer.get_max_length(), layer.is_sliding) == (0, -1, False)
    assert batch.nbytes == 0  # nothing allocated before the first write
    batch.concat(_two_layers(2))
    batch.concat(_two_layers(5))
    assert batch.layers[1].get_seq_length() == 5
    assert batch.layers[1].get_mask_sizes(3) == (8, 0)


def test_one_write_plan_serves_every_layer_of_a_step_and_is_rebuilt_after_it():
    batch = _two_layers(2)
    shape = torch.Size([1, 2, 1, 3])
    needed, index = batch.write_plan(shape, torch.device("cpu"))
    assert needed == 3 and index.shape == shape and index.eq(2).all()
    assert batch.write_plan(shape, torch.device("cpu"))[1] is index
    batch.advance(1)
    needed, index = batch.write_plan(shape, torch.device("cpu"))
    assert needed == 4 and index.eq(3).all()
    assert batch.starts.tolist() == [0]
    assert batch.starts.dtype == batch.lengths.dtype == torch.long  # slot indices


def _two_layers(length: int) -> SuffixCache:
    cache = SuffixCache(num_layers=2, batch_size=1)
    for layer_idx in range(2):
        keys = torch.full((1, 2, length, 3), float(length))
        cache.update(keys, keys, layer_idx)
    cache.advance(length)
    return cache
