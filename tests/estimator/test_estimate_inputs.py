"""Bad input to memplan.estimate gets one clear error naming the argument and the fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator import EstimateError
from memplan.estimator.api import estimate


def build():
    return nn.Sequential(nn.Linear(8, 4))


BATCH = (torch.randn(2, 8), torch.randint(0, 4, (2,)))


def loss(m, b):
    return F.cross_entropy(m(b[0]), b[1])


def test_unsupported_precision_names_the_valid_strings():
    with pytest.raises(EstimateError, match=r"precision must be one of .*bf16-mixed.*got 'fp16'"):
        estimate(build, BATCH, loss=loss, precision="fp16", device="cpu")


def test_loss_returning_a_non_scalar_says_to_reduce_it():
    with pytest.raises(EstimateError, match=r"scalar tensor; got shape \(2, 4\).*\.mean\(\)"):
        estimate(build, BATCH, loss=lambda m, b: m(b[0]), device="cpu")


def test_batch_the_model_rejects_names_the_batch():
    wrong = (torch.randn(2, 9), torch.randint(0, 4, (2,)))
    with pytest.raises(EstimateError, match=r"^batch: the model could not run aten\.addmm\.default\(float32\[4\], "
                       r"float32\[2, 9\], float32\[8, 4\]\) in `model\.0` on this batch") as err:
        estimate(build, wrong, loss=loss, device="cpu")
    assert "Pass the batch exactly as training_step receives it" in str(err.value)


def test_a_batch_missing_a_key_names_the_batch_and_where():
    with pytest.raises(EstimateError, match=r"^batch: the training step could not take this batch \(KeyError: 'y' at "
                       r".*test_estimate_inputs.py:\d+\)"):
        estimate(build, {"x": torch.randn(2, 8)}, loss=lambda m, b: F.cross_entropy(m(b["x"]), b["y"]), device="cpu")


class _Inner(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.proj, self.op = nn.Linear(8, 8), op

    def forward(self, x):
        return self.op(self.proj(x))


class _Deep(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.ModuleDict({"experts": _Inner(op)})])

    def forward(self, x):
        return self.layers[1]["experts"](self.layers[0](x)).sum()


_LIB = torch.library.Library("memplan_inputs_test", "DEF")
_LIB.define("opaque(Tensor x) -> Tensor")
_LIB.impl("opaque", lambda x: x.clone(), "CPU")


def test_an_op_without_a_fake_kernel_is_named_with_its_module_not_blamed_on_the_batch():
    model = _Deep(lambda x: torch.ops.memplan_inputs_test.opaque(x))
    with pytest.raises(EstimateError, match=r"^model: the op memplan_inputs_test\.opaque\.default\(float32\[2, 8\]\) "
                       r"failed in `model\.layers\.1\.experts` in the forward \(UnsupportedOperatorException: .*"
                       r"register_fake"):
        estimate(model, (torch.randn(2, 8),), device="cpu")


def test_a_mismatch_inside_the_model_names_the_op_and_module_not_the_batch():
    model = _Deep(nn.Linear(9, 8))
    with pytest.raises(EstimateError, match=r"^model: the op aten\.addmm\.default\(float32\[8\], float32\[2, 8\], "
                       r"float32\[9, 8\]\) failed in `model\.layers\.1\.experts\.op` in the forward \(RuntimeError: "
                       r".*Check that the model runs this step for real"):
        estimate(model, (torch.randn(2, 8),), device="cpu")


def test_a_failure_in_the_backward_is_one_estimate_error_naming_the_op():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return torch.ops.memplan_inputs_test.opaque(grad)

    with pytest.raises(EstimateError, match=r"^model: the op memplan_inputs_test\.opaque\.default\(float32\[2, 8\]\) "
                       r"failed at .*test_estimate_inputs.py:\d+ in the backward"):
        estimate(_Deep(Twice.apply), (torch.randn(2, 8),), device="cpu")


def test_a_torch_func_transform_in_the_step_is_named_with_a_variant_that_traces():
    """torch.func's grad / vjp / jacrev refuse saved-tensor hooks, under which memplan traces: one error naming it."""
    from torch.func import functional_call, jacrev, vmap

    def loss(model, x):
        params = dict(model.named_parameters())
        jacobian = vmap(jacrev(lambda row: functional_call(model, params, (row[None],))[0]))(x)
        return model(x).pow(2).mean() + jacobian.pow(2).mean()

    with pytest.raises(EstimateError, match=r"torch\.func transform .*at .*test_estimate_inputs\.py:\d+, which "
                       r"refuses.*saved-tensor hooks.*torch\.autograd\.grad"):  # the user's line, not contextlib's
        estimate(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), torch.randn(4, 8), loss=loss,
                 device="cpu")


def test_a_failed_trace_leaves_autograd_and_autocast_as_they_were():
    wrong = (torch.randn(2, 9), torch.randint(0, 4, (2,)))
    for device in ("cpu", "A100-80GB"):
        with pytest.raises(EstimateError):
            estimate(build, wrong, loss=loss, device=device, precision="bf16-mixed")
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CUDA's policy would give fp32 here
        assert F.layer_norm(x.bfloat16(), (8,)).dtype == torch.bfloat16


def test_builder_that_fails_names_the_model_callable():
    def broken():
        raise RuntimeError("config missing")

    with pytest.raises(EstimateError, match=r"^model: the callable that builds the model raised RuntimeError: config missing"):
        estimate(broken, BATCH, loss=loss, device="cpu")


def test_model_without_loss_asks_for_loss():
    with pytest.raises(EstimateError, match=r"^loss: the model returned a tensor of shape \(2, 4\), not a scalar loss.*Pass loss="):
        estimate(build, BATCH[0], device="cpu")


def test_unknown_optimizer_lists_the_names():
    with pytest.raises(EstimateError, match=r"optimizer must be one of sgd, sgd-momentum, adam, adamw"):
        estimate(build, BATCH, loss=loss, optimizer="lion", device="cpu")


def test_unknown_gpu_name_says_how_to_name_one():
    with pytest.raises(ValueError, match=r"^device: .*"):
        estimate(build, BATCH, loss=loss, device="GTX-9999")


def test_bf16_on_a_gpu_without_it_suggests_16_mixed():
    with pytest.raises(EstimateError, match=r"V100.*sm70.*use precision='16-mixed'"):
        estimate(build, BATCH, loss=loss, precision="bf16-mixed", device="V100-32GB")


def test_world_size_without_ddp_is_refused():
    with pytest.raises(EstimateError, match=r"world_size=4 needs strategy='ddp'"):
        estimate(build, BATCH, loss=loss, device="cpu", world_size=4)


def test_batch_without_tensors_is_refused():
    with pytest.raises(EstimateError, match=r"batch has no tensors"):
        estimate(build, [1, 2, 3], loss=loss, device="cpu")


def test_checkpointing_true_without_repeated_blocks_asks_for_classes():
    with pytest.raises(ValueError, match=r"found no repeated blocks.*checkpointing=\{BlockClass\}"):
        estimate(build, BATCH, loss=loss, checkpointing=True, device="cpu")


def test_data_dependent_op_on_activations_is_explained():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            h = self.lin(x)
            return h[h > 0].sum()  # shape depends on values

    with pytest.raises(EstimateError, match=r"aten.index.Tensor in Masked has an output whose shape depends on the values of an activation.*data_dependent='balanced'"):
        estimate(Masked, BATCH, loss=lambda m, b: m(b[0]), device="cpu", data_dependent="error")


def test_an_unknown_loop_names_every_order():
    with pytest.raises(EstimateError, match=r"^loop must be 'lightning' .*, 'torch' .*, 'torch-zero-after-forward' "
                                            r".* or 'torch-keep-grads' .*; got 'pytorch'"):
        estimate(build, BATCH, loss=loss, device="cpu", loop="pytorch")


def test_a_failed_builder_and_a_failed_step_are_told_apart():
    """The error says which failed, the callable that builds the model or the training step, and why;
    a builder that read values back from fake weights is told that they were answered."""
    def reads_a_weight():
        layer = nn.Linear(512, 512)
        count = int(layer.weight.abs().sum().item())
        return nn.Sequential(*[nn.Linear(8, 8)][:count], nn.Linear(8, 4)) if count else [][0]

    with pytest.raises(EstimateError, match=r"^model: the callable that builds the model raised IndexError: "
                                            r".*building on fake tensors, before any training step ran; it read "
                                            r"1 value\(s\) back from fake weights"):
        estimate(reads_a_weight, BATCH, loss=loss, device="cpu")

    class FailsInForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 4)

        def forward(self, x):
            raise RuntimeError("no such stage")

    with pytest.raises(EstimateError, match=r"^model: the training step raised RuntimeError: no such stage .*forward"):
        estimate(FailsInForward, BATCH, loss=loss, device="cpu")


class _PatchNet(torch.nn.Module):
    """A patch convolution too large to be made real while building (> 64 Ki elements: a fake weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 256, 16, 16)
        self.head = torch.nn.Linear(256, 2)

    def forward(self, x):
        return self.head(self.conv(x).flatten(2).mean(2))


def test_a_builder_that_converts_its_model_to_bf16_builds():
    # torch swaps a fake parameter for its converted copy in `module.to(dtype)` and refuses where the fake
    # mode holds a weak reference to it ("Couldn't swap Conv2d.weight"): the model is built on meta instead
    from memplan.estimator import estimate

    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    loss = lambda m, b: m(b).float().pow(2).mean()  # noqa: E731
    built = estimate(lambda: _PatchNet().to(torch.bfloat16), x, device="cpu", loss=loss)
    with torch.device("meta"):
        module = _PatchNet().to(torch.bfloat16)
    given = estimate(module, x, device="cpu", loss=loss)
    assert built.parameters == given.parameters == 2 * sum(p.numel() for p in module.parameters())
    assert built.peak_allocated == given.peak_allocated


def test_a_failure_carries_its_argument_detail_and_fix_as_fields():
    """What another layer acts on (a config blames its keys) is in fields, and the message is made of them."""
    wrong = (torch.randn(2, 9), torch.randint(0, 4, (2,)))
    with pytest.raises(EstimateError) as batch_err:
        estimate(build, wrong, loss=loss, device="cpu")
    err = batch_err.value
    assert (err.argument, err.stage) == ("batch", None)
    assert err.detail.startswith("the model could not run aten.addmm.default(") and err.cause.startswith("RuntimeError")
    assert err.fix.startswith("Pass the batch exactly as training_step receives it")
    assert str(err) == f"batch: {err.detail}. {err.fix}"

    def broken():
        raise RuntimeError("config missing")

    with pytest.raises(EstimateError) as build_err:
        estimate(broken, BATCH, loss=loss, device="cpu")
    err = build_err.value
    assert (err.argument, err.stage) == ("model", "build")
    assert err.cause.startswith("RuntimeError: config missing (while building on fake tensors")
    assert str(err) == f"model: the callable that builds the model raised {err.cause}. {err.fix}"


def test_checkpointing_without_repeated_blocks_is_its_own_error_type():
    from memplan.estimator.errors import NoRepeatedBlocks

    with pytest.raises(NoRepeatedBlocks) as caught:
        estimate(build, BATCH, loss=loss, checkpointing=True, device="cpu")
    assert caught.value.argument == "checkpointing" and str(caught.value).startswith("checkpointing=True found no")


def test_a_gpu_family_name_is_refused_as_device_not_as_a_flag():
    with pytest.raises(ValueError) as caught:
        estimate(build, BATCH, loss=loss, device="A100")
    assert str(caught.value) == "device: 'A100' is ambiguous: say A100-40GB or A100-80GB."


def test_an_optimizer_whose_step_needs_a_closure_is_refused_by_name_with_the_fix():
    """LBFGS re-runs the forward and backward inside its step as its values decide: one traced step cannot model it
    (it failed with a TypeError from deep inside the step before)."""
    with pytest.raises(EstimateError) as err:
        estimate(lambda: nn.Linear(8, 8), torch.randn(4, 8), loss=lambda m, b: m(b).sum(),
                 optimizer=lambda params: torch.optim.LBFGS(params), device="cpu")
    assert err.value.argument == "optimizer"
    assert "LBFGS.step() needs a closure" in str(err.value) and "optimizer='sgd'" in str(err.value)
