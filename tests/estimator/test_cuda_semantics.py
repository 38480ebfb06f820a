"""emulate_cuda: a CPU trace (real or fake tensors) follows CUDA's autocast, dropout and RMSNorm dispatch; the
optimizer defaults follow CUDA's foreach choice. Scaled dot-product attention is tests/estimator/test_cuda_sdpa.py's."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from cuda_emulation import BF16, FP16, FP32, cuda_autocast, fake_mode, modes, saved_tensors
from torch import nn

from memplan.estimator.cuda.autocast import SAME_ON_CPU, cpu_autocast_ops, cuda_policy
from memplan.estimator.cuda.semantics import apply_cuda_optimizer_defaults, emulate_cuda

# --- autocast policy ----------------------------------------------------------------------------

FP32_ON_CUDA = {
    "layer_norm": lambda x: F.layer_norm(x, (16,), torch.ones(16), torch.zeros(16)),
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: F.log_softmax(x, -1),
    "sum": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(-1),
    "group_norm": lambda x: F.group_norm(x.view(4, 16, 1), 4),
    "rms_norm": lambda x: F.rms_norm(x, (16,), torch.ones(16)),
    "exp": lambda x: x.exp(),
    "pow": lambda x: x.pow(2),
    "norm": lambda x: x.norm(),
    "cumsum": lambda x: x.cumsum(-1),
}


@modes()
@pytest.mark.parametrize("op", sorted(FP32_ON_CUDA))
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # CPU's rms_norm
def test_fp32_ops_run_in_fp32_as_on_cuda(mode, op):
    with mode():
        x = torch.randn(4, 16, dtype=BF16)  # e.g. the output of a linear under autocast
        with torch.autocast("cpu", dtype=BF16):
            cpu_dtype = FP32_ON_CUDA[op](x).dtype
        with cuda_autocast():
            cuda_dtype = FP32_ON_CUDA[op](x).dtype
    assert cpu_dtype == BF16  # CPU autocast's own policy, which the emulation must replace
    assert cuda_dtype == FP32


@modes()
def test_lower_precision_ops_stay_bf16_and_cpu_policy_returns_after_exit(mode):
    with mode():
        x, w = torch.randn(4, 16), torch.randn(16, 16, requires_grad=True)
        with cuda_autocast():
            assert F.linear(x, w).dtype == BF16
            assert (x @ w).dtype == BF16
            assert torch.mv(w, x[0]).dtype == BF16  # lower precision on CUDA only: Python kernel
            assert torch.einsum("ij,jk->ik", x, w).dtype == BF16
        with torch.autocast("cpu", dtype=BF16):
            assert F.layer_norm(x.to(BF16), (16,)).dtype == BF16
            assert x.prod().dtype == FP32 and x.to(BF16).prod().dtype == FP32


def test_policy_details():
    x, y = torch.randn(4, 16, dtype=BF16), torch.randn(4, 16)
    with cuda_autocast():
        assert x.sum(dtype=torch.float64).dtype == torch.float64  # an explicit dtype is respected
        assert torch.softmax(x, -1, dtype=BF16).dtype == BF16
        assert torch.addcmul(x, x, y).dtype == FP32  # promote: widest wins
        assert torch.addcmul(x, x, x).dtype == BF16
        assert torch.norm(x, 2, -1).dtype == FP32  # fp32_append_dtype
        assert torch.cat([x, x]).dtype == BF16  # CPU-only promote falls through
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(3), torch.rand(3))


def test_cross_entropy_follows_cuda_log_softmax_in_input_dtype():
    """CPU autocast casts cross_entropy_loss's input to fp32; CUDA does not wrap it, so its
    log_softmax(self, dim, self.dtype) runs in bf16 and nll_loss casts that to fp32."""
    logits = torch.randn(4, 16, dtype=BF16, requires_grad=True)
    target = torch.tensor([1, 2, 3, 4])

    def log_softmax_result(loss):
        node = loss.grad_fn
        while node.name() != "LogSoftmaxBackward0":
            node = node.next_functions[0][0]
        return node._saved_result.dtype

    with torch.autocast("cpu", dtype=BF16):
        assert log_softmax_result(F.cross_entropy(logits, target)) == FP32
    with cuda_autocast():
        loss = F.cross_entropy(logits, target)
    assert loss.dtype == FP32
    assert log_softmax_result(loss) == BF16


def test_weight_cast_is_cached_for_the_autocast_region():
    w, x = torch.randn(16, 16, requires_grad=True), torch.randn(16, requires_grad=True)

    kept = []  # every saved cast stays alive, so a freed copy's address cannot be reused by a later one

    def storages(fn):
        """Storages of the bf16 (16, 16) tensors autograd saved: the cast weight."""
        ptrs = set()

        def pack(tensor):
            if tensor.dtype == BF16 and tensor.shape == (16, 16):
                ptrs.add(tensor.untyped_storage().data_ptr())
                kept.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fn()
        return ptrs

    with emulate_cuda(compute_capability=(8, 0), autocast_dtype=BF16):
        with torch.autocast("cpu", dtype=BF16):
            first = storages(lambda: torch.mv(w, x))
            second = storages(lambda: torch.mv(w, x))
        with torch.autocast("cpu", dtype=BF16):  # a new region: the cache was cleared on exit
            third = storages(lambda: torch.mv(w, x))
    assert first & second  # same bf16 copy of w, as CUDA's cached_cast
    assert not first & third


def test_autocast_dtype_must_match_the_callers_autocast():
    with emulate_cuda(compute_capability=(8, 0), autocast_dtype=BF16):
        with torch.autocast("cpu", dtype=FP16), pytest.raises(RuntimeError, match="same dtype"):
            torch.randn(4).exp()


def test_policy_tables_match_this_torch():
    """Drift check: the hand-copied CUDA lists equal what the dispatcher registered on AutocastCUDA
    (cudnn_convolution* are CUDA-only ops), and the kept CPU kernels exist."""
    registered = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    registered = {name.removeprefix("aten::") for name in registered}
    assert set(cuda_policy()) | {"cudnn_convolution", "cudnn_convolution_transpose"} == registered
    assert SAME_ON_CPU <= cpu_autocast_ops()


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="compute_capability"):
        with emulate_cuda(compute_capability=8.0, autocast_dtype=None):
            pass
    with pytest.raises(ValueError, match="autocast_dtype"):
        with emulate_cuda(compute_capability=(8, 0), autocast_dtype=torch.float64):
            pass


# --- dropout ------------------------------------------------------------------------------------

DROPOUTS = {
    "F.dropout": lambda x, train: F.dropout(x, 0.25, train),
    "nn.Dropout": lambda x, train: nn.Dropout(0.25).train(train)(x),
    "torch.dropout": lambda x, train: torch.dropout(x, 0.25, train),
}


@modes()
@pytest.mark.parametrize("kind", sorted(DROPOUTS))
def test_training_dropout_saves_a_bool_mask(mode, kind):
    with mode():
        x = torch.randn(8, 32, requires_grad=True)
        _, cpu_saved = saved_tensors(lambda: DROPOUTS[kind](x, True))
        with emulate_cuda(compute_capability=(8, 0), autocast_dtype=None):
            out, saved = saved_tensors(lambda: DROPOUTS[kind](x, True))
            out.sum().backward()
    assert cpu_saved == [((8, 32), FP32)]  # CPU's _dropout_impl saves full-precision noise
    assert saved == [((8, 32), torch.bool)]
    assert out.grad_fn.name() == "NativeDropoutBackward0"
    assert x.grad.shape == x.shape


@modes()
@pytest.mark.parametrize("kind", sorted(DROPOUTS))
def test_eval_dropout_is_identity(mode, kind):
    with mode():
        x = torch.randn(8, 32, requires_grad=True)
        with emulate_cuda(compute_capability=(8, 0), autocast_dtype=None):
            out, saved = saved_tensors(lambda: DROPOUTS[kind](x, False))
    assert out is x and saved == []


def test_dropout_edge_probabilities_and_exit():
    x = torch.randn(8, 32, requires_grad=True)
    with emulate_cuda(compute_capability=(8, 0), autocast_dtype=None):
        assert F.dropout(x, 0.0, True) is x
        assert torch.equal(F.dropout(x, 1.0, True), torch.zeros_like(x))
    assert F.dropout(x, 0.25, True).grad_fn.name() == "MulBackward0"  # CPU path again


# --- RMSNorm and fp16 softmax -------------------------------------------------------------------

@modes()
def test_rms_norm_saves_input_and_rstd_as_on_cuda(mode):
    with mode():
        x, w = torch.randn(8, 64, dtype=BF16, requires_grad=True), torch.ones(64, dtype=BF16, requires_grad=True)
        _, cpu_saved = saved_tensors(lambda: F.rms_norm(x, (64,), w))
        with emulate_cuda(compute_capability=(8, 0), autocast_dtype=None):
            out, saved = saved_tensors(lambda: F.rms_norm(x, (64,), w))
            out.float().sum().backward()
    assert ((8, 64), FP32) in cpu_saved  # the composite keeps fp32 copies of a bf16 input
    assert out.grad_fn.name() == "FusedRmsNormBackward0"
    assert sorted(saved, key=str) == sorted([((8, 64), BF16), ((64,), BF16), ((8, 1), FP32)], key=str)
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_rms_norm_values_and_grads_match_the_composite():
    x, w = torch.randn(8, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    results = []
    for emulate in (False, True):
        x.grad = w.grad = None
        ctx = emulate_cuda(compute_capability=(8, 0), autocast_dtype=None) if emulate else contextlib.nullcontext()
        with ctx:
            out = F.rms_norm(x, (64,), w, eps=1e-5)
            out.pow(2).sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    for reference, emulated in zip(*results):
        torch.testing.assert_close(emulated, reference)


def test_fp16_softmax_to_fp32_makes_no_fp32_input_copy_on_fake_tensors():
    with fake_mode():
        x = torch.randn(8, 64, dtype=FP16, requires_grad=True)
        cpu = F.softmax(x, -1, dtype=FP32)
        with emulate_cuda(compute_capability=(8, 0), autocast_dtype=None):
            out = F.log_softmax(x, -1, dtype=FP32)
            out.sum().backward()
    assert cpu.grad_fn.next_functions[0][0].name() == "ToCopyBackward0"
    assert out.dtype == FP32 and out.grad_fn.next_functions[0][0].name() == "torch::autograd::AccumulateGrad"
    assert x.grad.dtype == FP16


# --- optimizer defaults -------------------------------------------------------------------------

def test_foreach_defaults_to_true_as_on_cuda():
    params = [nn.Parameter(torch.randn(4))]
    adamw = torch.optim.AdamW(params, foreach=None)
    explicit = torch.optim.AdamW(params, foreach=False)
    fused = torch.optim.AdamW(params, fused=True)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    differentiable = torch.optim.Adam(params, differentiable=True)
    tensor_lr = torch.optim.Adam(params, lr=torch.tensor(1e-3))
    adafactor = torch.optim.Adafactor(params)  # foreach=None means the for-loop on CUDA too
    lbfgs = torch.optim.LBFGS(params)
    for opt in (adamw, explicit, fused, sgd, differentiable, tensor_lr, adafactor, lbfgs):
        apply_cuda_optimizer_defaults(opt)
    assert adamw.param_groups[0]["foreach"] is True
    assert sgd.param_groups[0]["foreach"] is True
    assert explicit.param_groups[0]["foreach"] is False
    assert fused.param_groups[0]["foreach"] is None
    assert differentiable.param_groups[0]["foreach"] is None
    assert tensor_lr.param_groups[0]["foreach"] is None
    assert adafactor.param_groups[0]["foreach"] is None
    assert "foreach" not in lbfgs.param_groups[0]


def test_foreach_adamw_steps_on_fake_tensors():
    with fake_mode():
        model = nn.Linear(8, 8)
        opt = torch.optim.AdamW(model.parameters())
        apply_cuda_optimizer_defaults(opt)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        state = opt.state[model.weight]
    assert opt.param_groups[0]["foreach"] is True
    assert state["exp_avg"].shape == model.weight.shape
