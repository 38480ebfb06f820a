"""The bundled ViT demo (memplan.demos.ViT, used by benchmarks/configs/vit-l16.yaml): its batch is what its
training_step takes, its estimate matches a real CPU Trainer.fit, and bad shapes name the config key."""
from __future__ import annotations

import pytest

from memplan.demos import ViT
from memplan.estimator import estimate
from memplan.truth.measure import measure_cpu_peak

TINY = dict(num_classes=7, image_size=32, patch_size=8, d_model=32, n_layers=3, n_heads=4, mlp_dim=64)


def test_vit_l16_defaults_have_the_published_parameter_count():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = ViT()  # no weight allocated
    assert sum(p.numel() for p in model.parameters()) == 304_326_632  # ViT-L/16 with a 1000-class head


def test_a_small_vit_estimates_as_a_real_cpu_fit_measures():
    # (checkpointing settings on ViTs: tests/estimator/test_checkpoint_settings.py, transformers' ViT)
    est = estimate(lambda: ViT(**TINY), ViT(**TINY).example_batch(4), device="cpu", precision="bf16-mixed")
    truth = measure_cpu_peak(lambda: ViT(**TINY), lambda: ViT(**TINY).example_batch(4), precision="bf16-mixed")
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)


@pytest.mark.parametrize("bad, key", [(dict(image_size=30), "image_size"), (dict(n_heads=5), "d_model")])
def test_shapes_that_do_not_divide_name_the_config_key(bad, key):
    with pytest.raises(ValueError, match=rf"model\.init_args\.{key}"):
        ViT(**{**TINY, **bad})
