"""The optimizers memplan estimates by name (`--optimizer`, the optimizer setting of a config).

A leaf (no torch): a config's settings are checked with it before torch is imported; memplan.estimator.inputs
builds each of them.
"""
from __future__ import annotations

OPTIMIZER_NAMES: tuple[str, ...] = ("sgd", "sgd-momentum", "adam", "adamw", "rmsprop", "adagrad")
"""memplan's optimizer names: SGD (lr 1e-3), SGD with momentum 0.9, Adam, AdamW, RMSprop, Adagrad."""
