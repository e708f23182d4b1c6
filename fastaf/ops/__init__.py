"""fastaf's registered ops and their VJPs: the LoRA math on tensors, knowing nothing of models.

Each op family is one file in the same order (reference -> ``fastaf::`` ops with fakes and vmap
rules -> ``autograd.Function``s -> the public function): ``lora_linear`` (one adapter),
``lora_multi`` (a stack with per-row ids), ``lora_siblings`` (q/k/v, gate/up sharing one pass over
x), ``lora_group`` (eager siblings as one node), ``lora_decode`` (a decoding step's few rows), ``lora_branch`` (the LoRA beside a quantized layer),
``lora_dequant`` (a 4-bit weight dequantized inside the op). ``_levels`` holds the functorch level plumbing
they share, the only code that touches functorch's C API; see README.md beside this file.
"""
from ._levels import (GRAD, PLAIN_TYPES, allow_single_level, bottom, current_level, differentiated_around,
                      entered_in_grad_mode, get_unwrapped, grad_mode_beneath, interpreter_stack, is_wrapped, level_left,
                      level_token, maybe_level, noted, peek_interpreter, pop_layer, push_layer, single_level_allowed,
                      tracked_scope, transform_levels, unwrap_for_grad, wrap_for_grad)
from .lora_branch import lora_branch, lora_branch_multi
from .lora_group import group_fits, group_kernels_apply, lora_group
from .lora_decode import (DECODE_ROWS, decoding, expanded_decode, linear_decodes, linear_rows, lora_decode_shrink,
                          lora_linear_decode, lora_multi_decode, lora_multi_decode_shrink, multi_decoding,
                          multi_expanded_decode, multi_shares_decode, shares_decode, traced_decode)
from .lora_linear import IMPLS, check_use, lora_linear, routed_lora_linear
from .lora_multi import check_rows, lora_linear_multi, refuse_ids_under_vmap
from .lora_siblings import lora_linear_given_h, shareable, shared_h_fanned
