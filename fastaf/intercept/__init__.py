"""How a model's uses of a targeted weight reach fastaf's ops; no LoRA math here.

``scoped_call`` runs a model with an adapter: ``routes`` resolves which weights an adapter
targets, ``rules`` says which torch calls on such a weight compute a linear layer, ``mode`` (a
``TorchFunctionMode`` over a call) and ``carrier`` (eager weights carrying their adapter) apply
those rules, ``groups`` runs eager siblings as one op, and ``below_grad`` runs a call below one
eager ``torch.func.grad`` level.
"""
from .below_grad import call_below, grad_level
from .groups import Groups, learned
from .mode import LoRAMode, adapter_mode, module_mode
from .routes import Route, held_tensor, link_siblings, module_routes
from .scope import TRACED_FORWARDS, check_lost, combine, checkpoint_context, explicit_mode_active, scoped_call
from .use import branch_output, dequantized, packed_4bit
