"""Eight adapters trained at once over one frozen model, each on its own task, then served mixed.

    python examples/many_adapters.py [--steps 400] [--device cuda]

Task k is counting upward in steps of k + 1 (t, t+k+1, t+2k+2, ... mod the vocabulary). The eight
adapters live in one stacked pytree (``fa.stack``); every training batch holds one sequence per
task, and ``adapter_ids`` sends row k through adapter k, so one optimizer over the stack's leaves
trains all eight in one forward and backward. Then each adapter is scored on every task (it should
win its own), and ``fa.generate`` continues a mixed batch, each row with its own adapter.
On CUDA the grouped Triton kernels run it (``fastaf.kernels.lora_multi``); on CPU the batched
torch reference does.
"""
from __future__ import annotations

import argparse

import torch
import torch.utils._pytree as pytree
from transformers import LlamaConfig, LlamaForCausalLM

import fastaf as fa

VOCAB, SEQ, TASKS = 64, 16, 8


def sequences(task: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One sequence per entry of ``task``: (len(task), SEQ) counting in steps of task + 1."""
    start = torch.randint(0, VOCAB, (len(task), 1), generator=generator)
    return (start + (task[:, None] + 1) * torch.arange(SEQ)) % VOCAB


def accuracy(model, adapter, ids: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Next-token accuracy per row (the first half of each sequence is context)."""
    with torch.no_grad():
        logits = fa.functional_call(model, adapter, (batch,), adapter_ids=ids).logits
    pred = logits[:, SEQ // 2 - 1:-1].argmax(-1)
    return (pred == batch[:, SEQ // 2:]).float().mean(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny matmuls: threads cost more than they save
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).to(dev).eval().requires_grad_(False)
    lora = fa.LoRAConfig(r=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    stack = fa.stack([fa.init_adapter(model, lora, seed=k) for k in range(TASKS)])
    leaves, spec = pytree.tree_flatten(stack)
    leaves = [t.requires_grad_() for t in leaves]
    opt = torch.optim.AdamW(leaves, lr=1e-2)
    tasks = torch.arange(TASKS, device=dev)  # row k of every batch is task k, served by adapter k
    gen = torch.Generator().manual_seed(0)

    print(f"training {TASKS} adapters at once (r={lora.r}, {sum(t.numel() for t in leaves) / 1e3:.0f} k "
          f"parameters in one stack), one sequence per task per step")
    for step in range(1, args.steps + 1):
        batch = sequences(tasks.repeat(8).cpu(), gen).to(dev)  # 8 sequences per task
        loss = fa.functional_call(model, pytree.tree_unflatten(leaves, spec), (batch,), {"labels": batch},
                                  adapter_ids=tasks.repeat(8)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1 or step % 50 == 0:
            print(f"  step {step:4d}  loss {loss.item():.3f}")
    stack = pytree.tree_unflatten([t.detach() for t in leaves], spec)

    test = sequences(tasks.cpu(), torch.Generator().manual_seed(123)).to(dev)
    print("\nnext-token accuracy, adapter (rows) on task (columns):")
    print("       " + " ".join(f"  t{k}" for k in range(TASKS)))
    wins = 0
    for k in range(TASKS):
        acc = accuracy(model, stack, torch.full((TASKS,), k, device=dev), test)
        wins += int(acc.argmax()) == k
        print(f"  a{k}   " + " ".join(f"{a:4.2f}" for a in acc.tolist()))
    base = accuracy(model, None, None, test)
    print("  base " + " ".join(f"{a:4.2f}" for a in base.tolist()))
    print(f"each adapter best on its own task: {wins}/{TASKS}")

    ids = torch.tensor([3, 0, 7, -1], device=dev)
    prompts = sequences(ids.clamp(min=0).cpu(), torch.Generator().manual_seed(7))[:, :6].to(dev)
    out = fa.generate(model, stack, prompts, adapter_ids=ids, max_new_tokens=6, do_sample=False,
                      attention_mask=torch.ones_like(prompts), pad_token_id=0)
    print("\nserving a mixed batch (fa.generate, adapter_ids=[3, 0, 7, -1]):")
    for row, k in enumerate(ids.tolist()):
        who = f"adapter {k} (step {k + 1})" if k >= 0 else "base model"
        print(f"  {who:22s} {prompts[row].tolist()} -> {out[row, 6:].tolist()}")


if __name__ == "__main__":
    main()
