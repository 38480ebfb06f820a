import pytest
import torch

from memplan.batching import batch_size_of, resize_batch


def test_resize_shrinks_and_grows_every_batched_tensor_and_keeps_the_rest():
    batch = {"ids": torch.arange(12).view(4, 3), "labels": torch.arange(4), "scale": torch.tensor(2.0)}
    small = resize_batch(batch, 2)
    assert small["ids"].tolist() == [[0, 1, 2], [3, 4, 5]] and small["labels"].tolist() == [0, 1]
    big = resize_batch(batch, 6)
    assert big["ids"].shape == (6, 3) and big["labels"].tolist() == [0, 1, 2, 3, 0, 1]
    assert big["scale"] is batch["scale"]
    assert batch_size_of(resize_batch((torch.zeros(3, 5), torch.zeros(3)), 7)) == 7


def test_batch_without_a_common_batch_dimension_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"leading dimensions of its tensors are \[3, 4\]"):
        batch_size_of((torch.zeros(3, 2), torch.zeros(4)))
