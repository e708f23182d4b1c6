"""fastaf's mechanics on a random 2-layer Llama: a functional LoRA fine-tune and inference.

    python examples/counting.py [--steps 150]

It needs no download (the test suite runs it for a few steps as a smoke test); examples/demo.py
fine-tunes a pretrained model. The task is counting: every sequence is t, t+1, t+2, ... (mod
vocab). A randomly initialised model cannot do it; a rank-8 adapter learns it in a few hundred
steps. Training is a pure function of the adapter (``torch.func.grad_and_value``) with a
functional Adam over the adapter pytree; the model itself is never modified, which the script
checks at the end.

Runs on the GPU (bf16 activations, fp32 adapter) when there is one, else on the CPU in fp32.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch
import torch.utils._pytree as pytree
from transformers import LlamaConfig, LlamaForCausalLM

import fastaf as fa

VOCAB, SEQ, BATCH, STEPS, LR = 128, 32, 32, 150, 1e-2


def counting_batch(batch: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    return ((start + torch.arange(SEQ)) % VOCAB).to(device)  # (batch, SEQ)


def adam(params: fa.Adapter, grads: fa.Adapter, state: dict, step: int, lr: float = LR) -> fa.Adapter:
    """One functional Adam step over the adapter pytree (betas 0.9 / 0.999)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    state["m"] = pytree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    state["v"] = pytree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    c1, c2 = 1 - b1**step, 1 - b2**step
    return pytree.tree_map(
        lambda p, m, v: p - lr * (m / c1) / ((v / c2).sqrt() + eps), params, state["m"], state["v"]
    )


def bar(step: int, total: int, loss: float, tok_s: float) -> None:
    done = int(30 * step / total)
    sys.stdout.write(f"\r  [{'#' * done}{'.' * (30 - done)}] step {step:4d}/{total}  loss {loss:6.3f}  {tok_s:8.0f} tok/s")
    sys.stdout.flush()


def fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def greedy(model, adapter, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids = prompt
    for _ in range(new_tokens):
        logits = fa.functional_call(model, adapter, (ids,)).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids[:, prompt.shape[1]:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    steps = ap.parse_args().steps
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    before = fingerprint(model)
    lora_cfg = fa.LoRAConfig(r=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapter = fa.init_adapter(model, lora_cfg, seed=0)
    n_params = sum(t.numel() for t in pytree.tree_leaves(adapter))
    print(f"fastaf counting demo on {device} ({dtype}): random Llama, {sum(p.numel() for p in model.parameters()):,} frozen "
          f"params; adapter r={lora_cfg.r} on {len(adapter)} layers, {n_params:,} trainable")

    def loss_fn(ad: fa.Adapter, ids: torch.Tensor) -> torch.Tensor:
        return fa.functional_call(model, ad, (ids,), {"labels": ids}).loss

    step_fn = torch.func.grad_and_value(loss_fn)
    state = {"m": pytree.tree_map(torch.zeros_like, adapter), "v": pytree.tree_map(torch.zeros_like, adapter)}
    gen = torch.Generator().manual_seed(0)
    first = None
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        ids = counting_batch(BATCH, gen, device)
        grads, loss = step_fn(adapter, ids)
        adapter = adam(adapter, grads, state, step)
        if step == 1 or step % 10 == 0 or step == steps:
            if cuda:
                torch.cuda.synchronize()
            first = first if first is not None else loss.item()
            bar(step, steps, loss.item(), step * BATCH * SEQ / (time.perf_counter() - t0))
    print(f"\n  loss {first:.3f} -> {loss.item():.3f} in {time.perf_counter() - t0:.1f} s")

    prompt = torch.tensor([[40, 41, 42, 43], [120, 121, 122, 123]], device=device)
    print("inference (greedy, 8 new tokens), adapter passed explicitly:")
    for name, ad in (("base model", None), ("with adapter", adapter)):
        out = greedy(model, ad, prompt, 8)
        print(f"  {name:13s} {prompt[0].tolist()} -> {out[0].tolist()}   {prompt[1].tolist()} -> {out[1].tolist()}")
    after = fingerprint(model)
    print(f"base model fingerprint before {before}, after {after}: {'unchanged' if before == after else 'CHANGED'}")
    if before != after:
        raise SystemExit("the base model changed")


if __name__ == "__main__":
    main()
