"""Measuring real training steps: the truth estimates are held to. Never imported by memplan.estimator.

    counting  the CPU allocator's real total (c10's every-thread flag, the profiler's peak)
    runs      the training runs: a real Lightning `Trainer.fit` and a plain PyTorch loop
    measure   measure_cpu_peak / measure_cuda_peak over a run
"""
from memplan.truth.counting import allocator_counts_every_thread, counted_profile, peak_total_allocated
from memplan.truth.measure import CudaMeasurement, measure_cpu_peak, measure_cuda_peak
from memplan.truth.runs import Training, lightning_fit, plain_loop, train

__all__ = [
    "CudaMeasurement", "Training", "allocator_counts_every_thread", "counted_profile", "lightning_fit",
    "measure_cpu_peak", "measure_cuda_peak", "peak_total_allocated", "plain_loop", "train",
]
