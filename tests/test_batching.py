import pytest
import torch

from memplan.batching import batch_size_of, named_tensors, resize_batch, split_batch


def test_resize_shrinks_and_grows_every_batched_tensor_and_keeps_the_rest():
    batch = {"ids": torch.arange(12).view(4, 3), "labels": torch.arange(4), "scale": torch.tensor(2.0)}
    small = resize_batch(batch, 2)
    assert small["ids"].tolist() == [[0, 1, 2], [3, 4, 5]] and small["labels"].tolist() == [0, 1]
    big = resize_batch(batch, 6)
    assert big["ids"].shape == (6, 3) and big["labels"].tolist() == [0, 1, 2, 3, 0, 1]
    assert big["scale"] is batch["scale"]
    assert batch_size_of(resize_batch((torch.zeros(3, 5), torch.zeros(3)), 7)) == 7


@pytest.mark.parametrize("size", [4096, 4099])
def test_growing_a_batch_repeats_its_rows_in_one_contiguous_tensor_allocated_once(size):
    """The planner grows an example batch of a few samples to each micro-batch it traces (2**19 rows of 1000
    features for `memplan suggest` on configs/mlp.yaml at a global batch of 2**20): rows repeated cyclically, a
    contiguous tensor of exactly `size` rows, and no second copy of it on the way (repeat then clone held
    twice the bytes, and took most of that command's time)."""
    from torch.profiler import ProfilerActivity, profile

    from memplan.truth import peak_total_allocated

    x = torch.randn(4, 1000)
    labels = torch.arange(4)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grown_x, grown_labels = resize_batch((x, labels), size)
    rows = torch.arange(size) % 4
    assert torch.equal(grown_x, x[rows]) and torch.equal(grown_labels, labels[rows])
    assert grown_x.is_contiguous() and grown_x.untyped_storage().nbytes() == size * 1000 * 4
    assert peak_total_allocated(prof) <= size * (1000 * 4 + 8) + 4096  # the two grown tensors (and the
    # allocator's rounding), nothing twice


def test_batch_without_a_common_batch_dimension_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"leading dimensions of its tensors are \[3, 4\]"):
        batch_size_of((torch.zeros(3, 2), torch.zeros(4)))


def test_the_batch_size_is_what_most_tensors_share_and_per_batch_tensors_travel_whole():
    batch = {"x": torch.zeros(8, 3), "y": torch.zeros(8), "class_weights": torch.ones(5)}
    assert batch_size_of(batch) == 8
    chunk = split_batch(batch, 2, 5, 8)
    assert chunk["x"].shape == (3, 3) and chunk["y"].shape == (3,) and chunk["class_weights"] is batch["class_weights"]
    assert resize_batch(batch, 4)["class_weights"] is batch["class_weights"]


def test_dataclasses_and_namedtuples_are_walked_and_rebuilt_with_their_other_fields():
    from dataclasses import dataclass, field
    from typing import NamedTuple

    class Pair(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    @dataclass(frozen=True)
    class Batch:
        pair: Pair
        text: list[str]
        seen: int = field(default=0, init=False)

    batch = Batch(Pair(torch.zeros(4, 2), torch.zeros(4)), ["a", "b", "c", "d"])
    assert [p for p, _ in named_tensors(batch)] == ["batch.pair.a", "batch.pair.b"]
    half = split_batch(batch, 0, 2, 4)
    assert isinstance(half, Batch) and isinstance(half.pair, Pair) and half.pair.a.shape == (2, 2)
    assert half.text == ["a", "b"] and batch.text == ["a", "b", "c", "d"] and batch.pair.a.shape == (4, 2)


def test_a_batch_without_a_batch_dimension_names_its_fields():
    with pytest.raises(ValueError, match=r"no tensor in it has a batch dimension \(tensors: batch\['scale'\] \(\)"):
        batch_size_of({"scale": torch.tensor(1.0), "names": ["a"]})


def test_per_sample_lists_are_split_and_resized_with_the_tensors():
    """ids, file names, raw texts beside the tensors: a tensor-free list or tuple as long as the batch is
    one value a sample; one of another length, or one holding tensors, is not."""
    batch = {"x": torch.arange(4.0)[:, None], "ids": ["a", "b", "c", "d"], "paths": ("p0", "p1", "p2", "p3"),
             "size": (224, 224), "pair": [torch.zeros(4), torch.ones(4)], "meta": [{"n": i} for i in range(4)]}
    part = split_batch(batch, 1, 3, 4)
    assert part["ids"] == ["b", "c"] and part["paths"] == ("p1", "p2") and part["meta"] == [{"n": 1}, {"n": 2}]
    assert part["size"] == (224, 224) and [t.shape for t in part["pair"]] == [(2,), (2,)]
    one, six = resize_batch(batch, 1), resize_batch(batch, 6)
    assert one["ids"] == ["a"] and one["x"].shape == (1, 1) and one["size"] == (224, 224)
    assert six["ids"] == ["a", "b", "c", "d", "a", "b"] and six["paths"][4:] == ("p0", "p1") and six["x"].shape == (6, 1)
