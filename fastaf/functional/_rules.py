"""Which torch calls on a targeted weight compute a linear layer, shared by both interceptions:
the mode over a whole call (``_call._LoRAMode``) and the weights that carry their adapter
(``_carrier``).

    F.linear(x, W, b)        nn.Linear                          W (N, K)
    torch.addmm(b, x, W)     GPT-2's Conv1D                     W (K, N): the layout is "transposed"
    x @ W.T, x @ W           Falcon's FalconLinear; Conv1D's W  any transpose of an (N, K) W
"""
from __future__ import annotations

import torch

_TensorBase = torch._C.TensorBase
# funcs a mode sees for W.T, W.mT, W.t(), torch.t(W) and W.transpose(0, 1): each reverses a 2-D W
TRANSPOSES = {_TensorBase.T.__get__, _TensorBase.mT.__get__, _TensorBase.t, torch.t}
TRANSPOSE_DIMS = {_TensorBase.transpose, torch.transpose}
MATMULS = {_TensorBase.matmul, torch.matmul}  # x @ y reaches a mode as Tensor.matmul


def swaps(args: tuple, kwargs: dict) -> bool:
    """Whether ``transpose(t, dim0, dim1)`` of a 2-D t swaps its two dims (0/-2 with 1/-1)."""
    dims = list(args[1:3]) + [kwargs[k] for k in ("dim0", "dim1") if k in kwargs]
    return len(dims) == 2 and dims[0] % 2 != dims[1] % 2


def reverses(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` is a transpose of its first argument (a 2-D tensor)."""
    return func in TRANSPOSES or (func in TRANSPOSE_DIMS and swaps(args, kwargs))


def addmm_parts(args: tuple, kwargs: dict):
    """(bias, x, W) of a plain ``torch.addmm(bias, x, W)`` (beta = alpha = 1, no out=), else None."""
    if kwargs.get("out") is not None or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        return None
    names = ("input", "mat1", "mat2")
    parts = [args[i] if len(args) > i else kwargs.get(n) for i, n in enumerate(names)]
    return None if parts[1] is None or parts[2] is None else tuple(parts)


def linear_parts(args: tuple, kwargs: dict):
    """(x, W, bias) of ``F.linear``'s arguments."""
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return x, weight, bias
