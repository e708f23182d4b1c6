"""The LoRA as a branch beside a quantized layer (``fastaf.ops.lora_branch``) against the fp64
formula: its shape and dtype, dropout only in training, and gradients to the factors."""
from __future__ import annotations

import torch

import fastaf as fa
from fastaf.ops import lora_branch
from tests._tolerances import assert_close


def _lora(K=6, N=5, r=3, dropout=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return fa.LoRA(torch.randn(r, K, generator=g).to(dtype), torch.randn(N, r, generator=g).to(dtype), 0.5, dropout)


def test_the_branch_is_the_scaled_low_rank_term_in_the_inputs_dtype():
    lo = _lora()  # fp32 masters under a bf16 input: cast to it, as the op does
    x = torch.randn(2, 3, 6).to(torch.bfloat16)
    y = lora_branch(x, lo, training=False)
    assert y.shape == (2, 3, 5) and y.dtype == torch.bfloat16
    assert_close(y, 0.5 * (x.double() @ lo.A.double().T) @ lo.B.double().T, torch.bfloat16)


def test_dropout_is_drawn_in_training_only_and_gradients_reach_the_factors():
    lo = _lora(dropout=0.5, dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal(lora_branch(x, lo, training=False), 0.5 * (x @ lo.A.T) @ lo.B.T)
    torch.manual_seed(0)
    dropped = lora_branch(x, lo, training=True)
    torch.manual_seed(0)
    mask = torch.nn.functional.dropout(torch.ones_like(x), 0.5, True)
    assert_close(dropped, 0.5 * ((x * mask) @ lo.A.T) @ lo.B.T, torch.float64)
    A, B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    dy = torch.randn(4, 5, dtype=torch.float64)
    gA, gB = torch.autograd.grad(lora_branch(x, fa.LoRA(A, B, 0.5), training=False), (A, B), dy)
    assert_close(gA, 0.5 * (dy @ B).T @ x, torch.float64)
    assert_close(gB, 0.5 * dy.T @ (x @ A.T), torch.float64)


def test_a_stack_with_ids_gives_each_example_its_slots_branch_and_none_for_minus_one():
    from fastaf.ops import lora_branch_multi

    g = torch.Generator().manual_seed(1)
    stack = fa.LoRA(torch.randn(3, 2, 6, generator=g), torch.randn(3, 5, 2, generator=g), 0.5)
    x = torch.randn(4, 7, 6, generator=g)  # 4 examples of 7 rows
    ids = torch.tensor([2, -1, 0, 2])
    y = lora_branch_multi(x, stack, ids, training=False)
    assert y.shape == (4, 7, 5)
    for i, slot in enumerate(ids.tolist()):
        want = torch.zeros(7, 5) if slot < 0 else lora_branch(x[i], fa.LoRA(stack.A[slot], stack.B[slot], 0.5), False)
        assert_close(y[i], want.double(), torch.float32)
