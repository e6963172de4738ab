"""The architecture families users quantize (#69), each as a tiny model built from its transformers config with a
fixed seed: hidden 64, 2 layers, the byte-level test tokenizer's 384 tokens. Each family's own keys are the least that
give it its layout: sliding-window layers where the family has them (window 32, shorter than the tests' windows, so
that a sliding layer sees less than a full one), experts and their router, Multi-head Latent Attention and shared
experts (DeepSeek-V3), a recurrent layer beside an attention layer (the hybrids)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
EXPERTS = dict(num_experts_per_tok=2)
SLIDING = dict(sliding_window=32)

FAMILIES = {
    "llama": dict(head_dim=16),
    "mistral": SLIDING,
    # transformers reads the test tokenizer in a qwen2 folder as Qwen2Tokenizer, which adds <|endoftext|> as token
    # 384: the embeddings must hold it (gptqmodel's calibration pads with it)
    "qwen2": dict(vocab_size=512),
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, **SLIDING),  # soft-capped logits, [sliding, full] layers
    # 2 layers of the default pattern would both be sliding (a full one every 6th)
    "gemma3_text": dict(head_dim=16, layer_types=["sliding_attention", "full_attention"], **SLIDING),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),  # fused qkv and gate_up projections
    "qwen3_moe": dict(head_dim=16, num_experts=4, moe_intermediate_size=32, **EXPERTS),
    "mixtral": dict(num_local_experts=4, **EXPERTS),
    # YaRN by default from 4,096 positions: the config warns below that
    "gpt_oss": dict(head_dim=16, num_local_experts=4, max_position_embeddings=131072, **SLIDING, **EXPERTS),
    "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32, n_group=2, topk_group=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, **EXPERTS),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64, **EXPERTS),
    "qwen3_next": dict(head_dim=16, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"], **EXPERTS),
    "granitemoehybrid": dict(num_local_experts=4, shared_intermediate_size=64, layer_types=["mamba", "attention"],
                             mamba_n_heads=4, mamba_d_state=16, mamba_d_head=32, mamba_chunk_size=16, **EXPERTS),
}
# the families whose layers keep a recurrent state beside their attention
HYBRIDS = ("qwen3_next", "granitemoehybrid")


def build_family(family: str, folder: Path | None = None, tokenizer=None, seed: int = 0, **overrides):
    """A tiny model of ``family`` (a key of ``FAMILIES``) with random weights, in evaluation mode; saved with
    ``tokenizer`` into ``folder`` when given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if folder is not None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return model
