"""PyTorch integration: differentiable attention as ``torch.library`` custom ops, and an attention
backend for Hugging Face transformers.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)   # autograd and torch.compile aware

    cuflash.torch.register_transformers()                 # attn_implementation="cuFlash"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="cuFlash")

    with cuflash.torch.record_plans() as plans:           # which kernels ran, per shape
        model.generate(...)

    cuflash.torch.activate_sdpa()                         # F.scaled_dot_product_attention's
    cuflash.torch.restore_sdpa()                          # flash path on cuflash, and back

The forward and backward passes are the custom ops ``cuflash::attention_fwd`` /
``cuflash::attention_bwd`` (and ``cuflash::attention_varlen_fwd`` / ``..._bwd``), each with a fake
(meta) implementation, so ``torch.compile(fullgraph=True)`` traces through them without a graph
break. Outside of autograd and compilation, :func:`attention` calls :func:`cuflash.attention`
directly (the dispatcher adds host time to every call, which matters when decoding).

Modules: ``ops`` (the custom ops and :func:`attention` / :func:`attention_varlen`), ``hf`` (the
transformers backend), ``plans`` (:func:`record_plans`) and ``sdpa`` (cuflash behind
``torch.nn.functional.scaled_dot_product_attention``: :func:`activate_sdpa`, also registered as
``"cuflash"`` in ``torch.nn.attention``'s flash-attention registry on PyTorch >= 2.11). This
package imports torch; ``import cuflash`` alone never does.
"""
from .hf import HF_NAME, hf_attention_forward, register_transformers
from .ops import attention, attention_varlen
from .plans import PlanRecord, last_plans, record_plans
from .sdpa import activate_sdpa, restore_sdpa, sdpa_active

__all__ = ["attention", "attention_varlen", "register_transformers", "hf_attention_forward",
           "record_plans", "last_plans", "PlanRecord", "HF_NAME", "activate_sdpa", "restore_sdpa",
           "sdpa_active"]
