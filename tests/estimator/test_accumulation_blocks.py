"""A gradient accumulation the autograd engine does in place takes no block of its own in the CUDA allocator model."""
from __future__ import annotations

import pytest

from memplan.estimator.api import estimate
from memplan.units import MiB

pytest.importorskip("transformers")


def test_a_tied_embeddings_in_place_gradient_sum_caches_no_segment_of_its_own():
    """T5's shared embedding (32128 x 256 fp32, 31.4 MiB) gets two gradients, the LM head's and the embedding's,
    which the engine sums in place. The trace sums them out of place; the allocator model then cut a 32 MiB segment
    for a sum the real run never held, and reserved stood 32 MiB above an H100's (t5-b4-16mixed-gpu: 478,150,656 B
    estimated, 444,596,224 B measured, gpu_campaign_raw_h100/part1.json). Now the sum takes the gradient's block."""
    from benchmarks.zoo import CASES

    case = CASES["t5-b4"]
    est = estimate(case.build, case.make_batch(case.batch_size), loss=case.loss, optimizer=case.optimizer,
                   precision="16-mixed", device="H100")
    assert est.peak_reserved - est.peak_allocated < 32 * MiB
