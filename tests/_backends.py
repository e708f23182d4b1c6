"""A ``torch.compile`` backend that records which fastaf ops AOTAutograd's graphs call."""
from __future__ import annotations

from collections import Counter

import torch
from torch._dynamo.backends.common import aot_autograd


def fastaf_ops_backend() -> tuple[object, Counter]:
    """(backend, counts): ``aot_eager`` that also counts each ``torch.ops.fastaf`` op in the
    forward and backward graphs, e.g. ``counts["lora_linear_bwd"]`` (the op names, no overload)."""
    counts: Counter = Counter()

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        for node in gm.graph.nodes:
            target = node.target
            if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                    and target.namespace == "fastaf":
                counts[target._opname] += 1
        return gm

    return aot_autograd(fw_compiler=record, bw_compiler=record), counts
