"""``ops.lora_dequant``: the LoRA linear over a bitsandbytes 4-bit weight dequantized inside the op,
against bitsandbytes' own dequantization and the float64 reference on the dense weight; the
Triton kernels under ``TRITON_INTERPRET=1`` (fp32: the interpreter's bf16 dot is not exact)."""
from __future__ import annotations

import pytest
import torch

import fastaf as fa
from fastaf.ops.lora_dequant import Layout4bit, Packed4bit, dequantize, lora_linear_4bit

bnb_functional = pytest.importorskip("bitsandbytes.functional")
from fastaf.kernels.hardware import available  # noqa: E402

TRITON = available(torch.empty(0))  # on the CPU: under TRITON_INTERPRET=1 (make test)

N, K, R = 48, 128, 4


def _quantized(quant_type: str, nested: bool):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) / 8
    q, state = bnb_functional.quantize_4bit(w, quant_type=quant_type, compress_statistics=nested)
    layout = Layout4bit(state.blocksize, quant_type, tuple(state.shape), state.dtype,
                        state.state2.blocksize if nested else 0)
    extra = (state.state2.absmax, state.state2.code, state.offset) if nested else ()
    return Packed4bit(layout, q, state.absmax, *extra), bnb_functional.dequantize_4bit(q, state)


CASES = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]


@pytest.mark.parametrize("quant_type,nested", CASES)
def test_dequantize_equals_bitsandbytes(quant_type, nested):
    weight, want = _quantized(quant_type, nested)
    got = dequantize(weight.layout, *weight.tensors)
    assert got.shape == (N, K) and got.dtype == torch.float32
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("quant_type,nested", CASES)
def test_forward_and_gradients_equal_the_reference_on_the_dense_weight(quant_type, nested, impl):
    if impl == "triton" and not TRITON:
        pytest.skip("no Triton interpreter (TRITON_INTERPRET=1)")
    weight, dense = _quantized(quant_type, nested)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, K, generator=g, requires_grad=True)
    bias = torch.randn(N, generator=g, requires_grad=True)
    a = (torch.randn(R, K, generator=g) / 4).requires_grad_()
    b = (torch.randn(N, R, generator=g) / 4).requires_grad_()
    y = lora_linear_4bit(x, weight, bias, fa.LoRA(a, b, 0.5), impl=impl)
    x64, bias64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, bias, a, b))
    want = x64 @ dense.double().T + bias64 + 0.5 * (x64 @ a64.T) @ b64.T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    dy = torch.randn(y.shape, generator=g)
    grads = torch.autograd.grad((y * dy).sum(), (x, bias, a, b))
    wants = torch.autograd.grad((want * dy.double()).sum(), (x64, bias64, a64, b64))
    for name, got, ref in zip(("dx", "dbias", "dA", "dB"), grads, wants):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_nothing_dense_is_saved_for_backward():
    """The backward dequantizes again: what autograd keeps is the packed weight, no (N, K) float."""
    weight, _ = _quantized("nf4", True)
    x = torch.randn(3, K, requires_grad=True)
    lora = fa.LoRA(torch.randn(R, K, requires_grad=True), torch.randn(N, R, requires_grad=True), 1.0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_linear_4bit(x, weight, None, lora)
    assert not any(t.is_floating_point() and t.shape == (N, K) for t in saved)
    assert any(t is weight.packed for t in saved)


def test_a_lora_that_does_not_fit_is_named():
    weight, _ = _quantized("nf4", False)
    with pytest.raises(ValueError, match=r"q_proj: LoRA A \(4, 64\) / B \(48, 4\) does not fit weight \(48, 128\)"):
        lora_linear_4bit(torch.randn(3, K), weight, None, fa.LoRA(torch.randn(R, 64), torch.randn(N, R), 1.0),
                         where="q_proj")


def test_under_autocast_the_op_computes_in_autocasts_dtype():
    """As autocast casts F.linear's operands (bitsandbytes' path): x and the dense weight in bf16,
    and a backward whose incoming gradient is bf16 (trl's SFTTrainer trains under CPU autocast)."""
    weight, dense = _quantized("nf4", True)
    x = torch.randn(3, K, requires_grad=True)
    lora = fa.LoRA(torch.randn(R, K, requires_grad=True), torch.randn(N, R, requires_grad=True), 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora_linear_4bit(x, weight, None, lora)
        want = torch.nn.functional.linear(x, dense) + 0.5 * torch.nn.functional.linear(
            torch.nn.functional.linear(x, lora.A), lora.B)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and lora.A.grad.dtype == torch.float32
