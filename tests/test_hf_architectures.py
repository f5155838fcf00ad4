"""The transformers backend across model families: small random models of each architecture on the
cuflash backend against the same weights on transformers' eager attention (scaling, softcap,
sliding windows, GQA, partial rotary, query/key norms, left padding, a KV cache in generation).
On the CPU cuflash's kernels are replaced by the reference (test_torch_integration.ref_kernels);
on a GPU they run for real in bfloat16."""
import pytest

from conftest import requires_gpu
from test_torch_integration import ref_kernels, requires_transformers  # noqa: F401 (a fixture)

torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False)
# (config class name, its options beyond COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=8, attn_logit_softcapping=20.0,
                                    final_logit_softcapping=None, query_pre_attn_scalar=24)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=8, num_key_value_heads=4)),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.25, num_key_value_heads=4)),
    "olmo2": ("Olmo2Config", {}),
    # layer 1 slides (the layers from max_window_layers on)
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # attention sinks (s_aux) on a sliding and a full layer; MoE
    "gpt_oss": ("GptOssConfig", dict(head_dim=32, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"])),
    # chunked attention (21 tokens over chunks of 8) on layer 0, a full no-RoPE layer 1 (no_rope_layers' rule)
    "llama4": ("Llama4TextConfig", dict(head_dim=32, intermediate_size_mlp=256, num_local_experts=2,
                                        attention_chunk_size=8, no_rope_layers=[1, 0])),
    "cohere2": ("Cohere2Config", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    # MLA: query/key head dim 48, value head dim 32 (V padded); MoE on layer 1
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                                             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                             first_k_dense_replace=1, moe_intermediate_size=64)),
    # MLA with a value head dim (48) wider than the query/key one (32)
    "deepseek_v3_wide_v": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                                                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=48,
                                                    first_k_dense_replace=2)),
    # sinks on the sliding layer only, whose kv heads double; value head dim 32 under query/key 48
    "mimo_v2_flash": ("MiMoV2FlashConfig", dict(head_dim=48, v_head_dim=32, sliding_window=8, n_routed_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=64)),
    "phi": ("PhiConfig", dict(num_key_value_heads=4, partial_rotary_factor=0.5)),  # partial rotary, no GQA
    "granite": ("GraniteConfig", dict(attention_multiplier=0.05)),  # a scaling other than 1/sqrt(d)
    "mixtral": ("MixtralConfig", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
    # a sliding layer 0, a full no-RoPE layer 1
    "smollm3": ("SmolLM3Config", dict(pad_token_id=0, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"])),
    "olmo3": ("Olmo3Config", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    # bidirectional attention (not causal), a symmetric window on the sliding layer
    "gemma3_bidirectional": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                                      use_bidirectional_attention=True,
                                                      layer_types=["sliding_attention", "full_attention"])),
    # layers 2 and 3 attend over the keys of layers 0 and 1 (KV sharing across layers)
    "gemma3n": ("Gemma3nTextConfig", dict(head_dim=32, sliding_window=8, num_hidden_layers=4, num_kv_shared_layers=2,
                                          layer_types=["sliding_attention", "full_attention"] * 2,
                                          intermediate_size=[256] * 4, activation_sparsity_pattern=[0.0] * 4,
                                          vocab_size_per_layer_input=512, hidden_size_per_layer_input=16,
                                          laurel_rank=8)),
}


def _pair(family, dtype="float32", device="cpu"):
    """The same random weights on the cuflash backend and on eager attention."""
    import transformers
    import cuflash.torch as ct
    name, over = FAMILIES[family]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    ct.register_transformers()
    cfg = dict(COMMON, **over)
    if family == "gpt_neox":
        cfg.pop("num_key_value_heads")
    models = []
    for attn in ("cuFlash", "eager"):
        torch.manual_seed(0)
        config = getattr(transformers, name)(**cfg)
        models.append(transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                                    dtype=getattr(torch, dtype)).to(device).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


def _inputs(device="cpu"):
    """Two rows of 21 tokens, the first left-padded by 5."""
    ids = torch.randint(1, 512, (2, 21), generator=torch.Generator().manual_seed(7)).to(device)
    mask = torch.ones(2, 21, dtype=torch.long, device=device)
    mask[0, :5] = 0
    return ids, mask


@requires_transformers
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_family_matches_eager(ref_kernels, family):  # noqa: F811 (the fixture)
    """Logits of a padded batch (the unpadded positions) and 8 greedy tokens (a KV cache) equal
    eager attention's on the CPU, through cuflash's entry points."""
    a, b = _pair(family)
    ids, mask = _inputs()
    with torch.no_grad():
        la, lb = a(ids, attention_mask=mask).logits, b(ids, attention_mask=mask).logits
        torch.testing.assert_close(la[0, 5:], lb[0, 5:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(la[1], lb[1], rtol=1e-4, atol=1e-4)
        ta = a.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        tb = b.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ta, tb)
    assert ref_kernels, "cuflash was not called"


@requires_gpu
@requires_transformers
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpu_hf_family_against_float32(family):
    """On the GPU in bfloat16: the logits' error against the float32 eager model at most twice
    eager bfloat16's (plus a small floor), on a padded batch."""
    a, b = _pair(family, "bfloat16", "cuda")
    ids, mask = _inputs("cuda")
    ref = _pair(family, "float32", "cuda")[1]
    ref.load_state_dict({k: v.float() for k, v in b.state_dict().items()})
    with torch.no_grad():
        la, lb, lr = (m(ids, attention_mask=mask).logits.float() for m in (a, b, ref))
    for row, start in ((0, 5), (1, 0)):
        err = (la[row, start:] - lr[row, start:]).abs().max().item()
        base = (lb[row, start:] - lr[row, start:]).abs().max().item()
        assert err <= 2 * base + 1e-2, (family, row, err, base)
