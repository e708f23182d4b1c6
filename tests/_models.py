"""Tiny randomly initialised Hugging Face models (no hub access), and adapter makers for tests.

Eager attention everywhere: SDPA on CPU has no vmap batching rule, and the suite turns vmap's
"performance drop" fallback warning into an error.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import fastaf as fa

VOCAB = 96
_DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
)


def _seeded(model_cls, config, seed: int, dtype: torch.dtype):
    torch.manual_seed(seed)
    return model_cls(config).to(dtype).eval()


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2) -> LlamaForCausalLM:
    """``layers=1`` where a test compiles: dynamo traces each layer (~20 s a layer on CI's 2 cores)."""
    return _seeded(LlamaForCausalLM, LlamaConfig(**{**_DECODER, "num_hidden_layers": layers}), seed, dtype)


def tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2) -> Qwen2ForCausalLM:
    """Qwen2 has a bias on q/k/v_proj."""
    return _seeded(Qwen2ForCausalLM, Qwen2Config(**{**_DECODER, "num_hidden_layers": layers}), seed, dtype)


def tiny_gpt2(seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2) -> GPT2LMHeadModel:
    """GPT-2's attention and MLP are transformers Conv1D layers (weight stored (in, out))."""
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64, attn_implementation="eager")
    return _seeded(GPT2LMHeadModel, cfg, seed, dtype)


def tiny_falcon(seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2) -> FalconForCausalLM:
    """Falcon's FalconLinear computes ``x @ self.weight.T``, not F.linear."""
    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                       new_decoder_architecture=False, attn_implementation="eager")
    return _seeded(FalconForCausalLM, cfg, seed, dtype)


def tiny_bart(seed: int = 0, dtype: torch.dtype = torch.float32) -> BartForConditionalGeneration:
    """An encoder-decoder: ``generate`` runs the encoder outside ``model.forward``."""
    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                     forced_eos_token_id=None, attn_implementation="eager")
    return _seeded(BartForConditionalGeneration, cfg, seed, dtype)


MODELS = {
    "llama": (tiny_llama, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen2": (tiny_qwen2, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "gpt2": (tiny_gpt2, ["c_attn", "c_proj", "c_fc"]),
    "falcon": (tiny_falcon, ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
}


def random_adapter(model, targets, r: int = 4, alpha: float = 8.0, seed: int = 0, **kw) -> fa.Adapter:
    """An adapter with non-zero B (a fresh init has B = 0, which would hide errors in B's path)."""
    ad = fa.init_adapter(model, fa.LoRAConfig(r=r, alpha=alpha, targets=targets, **kw), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return ad.map(lambda p, l: dataclasses.replace(l, B=(torch.randn(l.B.shape, generator=g) * 0.1).to(l.B)))


def tiny_mixtral(seed: int = 0, dtype: torch.dtype = torch.float32, experts: str = "batched_mm", layers: int = 2):
    """Fused 3-D experts: gate_up_proj (E, 2I, H), down_proj (E, H, I), router mlp.gate (E, H).
    ``experts``: transformers' experts implementation; batched_mm runs under vmap (eager's
    nonzero and grouped_mm's histc do not)."""
    import transformers

    cfg = transformers.MixtralConfig(**{**_DECODER, "num_hidden_layers": layers}, num_local_experts=4,
                                     num_experts_per_tok=2, experts_implementation=experts)
    cfg.intermediate_size = 48  # 2I != H and I != H: a swapped layout cannot pass by accident
    return _seeded(transformers.MixtralForCausalLM, cfg, seed, dtype)


def tiny_qwen3_moe(seed: int = 0, dtype: torch.dtype = torch.float32, experts: str = "batched_mm"):
    import transformers

    cfg = transformers.Qwen3MoeConfig(**_DECODER, moe_intermediate_size=24, head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, experts_implementation=experts)
    return _seeded(transformers.Qwen3MoeForCausalLM, cfg, seed, dtype)


def token_batch(batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


# ---- more families, each with its own inputs: (maker, targets, inputs(seed) -> kwargs) ----------

_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _causal(cls_name: str, cfg_name: str, **extra):
    def make(seed: int = 0, dtype: torch.dtype = torch.float32):
        import transformers

        cfg = getattr(transformers, cfg_name)(vocab_size=VOCAB, attn_implementation="eager", **extra)
        return _seeded(getattr(transformers, cls_name), cfg, seed, dtype)

    return make


def _ids(seed: int = 0) -> dict:
    ids = token_batch(seed=seed)
    return {"input_ids": ids, "labels": ids}


def _classify(seed: int = 0) -> dict:
    return {"input_ids": token_batch(seed=seed), "labels": torch.tensor([0, 1])}


def _pixels(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "labels": torch.tensor([0, 1])}


def _seq2seq(seed: int = 0) -> dict:
    ids = token_batch(seed=seed)
    return {"input_ids": ids, "labels": token_batch(seq=5, seed=seed + 1)}


def _speech(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_features": torch.randn(2, 8, 16, generator=g), "labels": token_batch(seq=5, seed=seed + 1)}


def _image_text(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": token_batch(seed=seed), "pixel_values": torch.randn(2, 3, 16, 16, generator=g), "return_loss": True}


IMAGE_TOKEN = VOCAB - 1


def _llava_inputs(seed: int = 0) -> dict:
    """4 image tokens: a 16x16 image in 8x8 patches, CLS dropped (vision_feature_select_strategy)."""
    ids = token_batch(seq=8, seed=seed) % IMAGE_TOKEN
    ids[:, 1:5] = IMAGE_TOKEN
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=g), "labels": ids}


def _towers(cls_name: str, cfg_name: str, **extra):
    """A text and a vision tower (CLIP, SigLIP), each _SMALL."""
    text = dict(vocab_size=VOCAB, **_SMALL, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal(cls_name, cfg_name, text_config=text, vision_config=dict(**_SMALL, image_size=16, patch_size=8),
                   **extra)


def tiny_llava(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A CLIP vision tower, a projector and a Llama; generate runs the tower outside forward's
    decoding steps (only the first step sees pixel_values)."""
    import transformers

    cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**_SMALL, image_size=16, patch_size=8),
        text_config=transformers.LlamaConfig(vocab_size=VOCAB, **_SMALL, num_key_value_heads=2),
        image_token_index=IMAGE_TOKEN, attn_implementation="eager",
    )
    return _seeded(transformers.LlavaForConditionalGeneration, cfg, seed, dtype)


def logits(out):
    """The logits of a model output (CLIP and SigLIP: image-text similarities)."""
    return out["logits"] if "logits" in out else out["logits_per_image"]


_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_ENCODER = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
ARCHS = {
    "mistral": (_causal("MistralForCausalLM", "MistralConfig", **_SMALL, num_key_value_heads=2), _LLAMA_LIKE, _ids),
    "qwen3": (_causal("Qwen3ForCausalLM", "Qwen3Config", **_SMALL, num_key_value_heads=2, head_dim=8), _LLAMA_LIKE, _ids),
    "gemma3": (_causal("Gemma3ForCausalLM", "Gemma3TextConfig", **_SMALL, num_key_value_heads=2, head_dim=8), _LLAMA_LIKE, _ids),
    "gemma2": (_causal("Gemma2ForCausalLM", "Gemma2Config", **_SMALL, num_key_value_heads=2, head_dim=8), _LLAMA_LIKE, _ids),
    "phi3": (_causal("Phi3ForCausalLM", "Phi3Config", **_SMALL, pad_token_id=0), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], _ids),
    "gpt_neox": (_causal("GPTNeoXForCausalLM", "GPTNeoXConfig", **_SMALL),
                 ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], _ids),
    "opt": (_causal("OPTForCausalLM", "OPTConfig", hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    word_embed_proj_dim=32, max_position_embeddings=64), ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], _ids),
    "gptj": (_causal("GPTJForCausalLM", "GPTJConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64),
             ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"], _ids),
    "stablelm": (_causal("StableLmForCausalLM", "StableLmConfig", **_SMALL, num_key_value_heads=2), _LLAMA_LIKE, _ids),
    "bert": (_causal("BertForSequenceClassification", "BertConfig", **_SMALL, num_labels=2), ["query", "key", "value", "dense"], _classify),
    "roberta": (_causal("RobertaForSequenceClassification", "RobertaConfig", **_SMALL, num_labels=2, pad_token_id=1),
                ["query", "key", "value", "dense"], _classify),
    "t5": (_causal("T5ForConditionalGeneration", "T5Config", d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                   decoder_start_token_id=0), ["q", "k", "v", "o", "wi", "wo"], _seq2seq),
    "whisper": (_causal("WhisperForConditionalGeneration", "WhisperConfig", d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        num_mel_bins=8, max_source_positions=8, max_target_positions=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=3), _ENCODER, _speech),
    "clip": (_towers("CLIPModel", "CLIPConfig", projection_dim=16), _ENCODER, _image_text),
    # SigLIP's pooling head is an nn.MultiheadAttention whose out_proj weight PEFT never adapts
    "siglip": (_towers("SiglipModel", "SiglipConfig"), ["q_proj", "k_proj", "v_proj", "self_attn.out_proj", "fc1", "fc2"],
               _image_text),
    "llava": (tiny_llava, [*_LLAMA_LIKE, "out_proj", "fc1", "fc2", "linear_1", "linear_2"], _llava_inputs),
    "mixtral": (tiny_mixtral, "all-linear", _ids),
    "qwen3_moe": (tiny_qwen3_moe, "all-linear", _ids),
    "vit": (lambda seed=0, dtype=torch.float32: _seeded(
        __import__("transformers").ViTForImageClassification,
        __import__("transformers").ViTConfig(**_SMALL, image_size=16, patch_size=8, num_labels=2, attn_implementation="eager"),
        seed, dtype), ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"], _pixels),
}
