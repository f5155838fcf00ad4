"""An attention backend for Hugging Face transformers running cuflash: :func:`hf_attention_forward`
and :func:`register_transformers`."""
import os
import warnings
import weakref

import torch

from .ops import attention, attention_varlen


_warned: set = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class _PerTensorMemo:
    """Remembers results per (tensor, version, extra) for the last few tensors: every layer of a
    forward pass gets the same mask / position_ids tensor (one per layer type), so their
    host-side lengths are read once per pass, not once per layer."""

    def __init__(self, size=4):
        self.size, self.entries = size, []  # [(weakref, key, value)], most recent last

    def get(self, t, extra, compute):
        """``compute(t)``, or its remembered value for the same tensor, version and ``extra``."""
        if torch.compiler.is_compiling():
            return compute(t)
        # (an inference tensor has no version counter, and outside inference mode no in-place change)
        key = (-1 if t.is_inference() else t._version, extra)
        for ref, k, value in self.entries:
            if ref() is t and k == key:
                return value
        value = compute(t)
        self.entries = [e for e in self.entries if e[0]() is not None][-(self.size - 1):]
        self.entries.append((weakref.ref(t), key, value))
        return value


_mask_memo, _mask_q_memo, _posid_memo = _PerTensorMemo(), _PerTensorMemo(), _PerTensorMemo()


def _unpad_data(mask):
    """(batch, seqlen) mask -> (flat indices of kept tokens, cu_seqlens int32, max length)."""
    mask = mask.bool()
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_len = int(seqlens.max()) if seqlens.numel() else 0  # host read, once per pass
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu, max_len


def _packed_data(position_ids):
    """Batch-1 position_ids of several packed sequences -> (cu_seqlens, max length), or None
    when they are one increasing sequence (read on the host once per pass)."""
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().flatten().to(torch.int32)
    if starts.numel() <= 1:
        return None
    total = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    cu = torch.cat([starts, total])
    if int(cu[0]) != 0:
        return None
    return cu, int(cu.diff().max())


def _gather_rows(x, flat_idx, seqlen):
    """x[b, s] for flat indices b * seqlen + s: one gather, whatever x's strides."""
    return x[flat_idx // seqlen, flat_idx % seqlen]


def _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                   softcap, causal, kwargs, why):
    """PyTorch SDPA through transformers' own backend, for masks cuflash cannot express."""
    if softcap:
        raise NotImplementedError(f"cuflash backend: {why}, and the SDPA fallback has no softcap")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"cuflash backend: {why}, and the SDPA fallback has no attention sinks (s_aux)")
    _warn_once(why, f"cuflash backend: {why}; using PyTorch SDPA for these calls")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if attention_mask is not None and attention_mask.dim() == 2:
        # padding mask (batch, kv_len) -> boolean (batch, 1, q_len, kv_len) with the causal and
        # sliding-window limits aligned bottom-right; rows that see no key output zeros
        b, _, sq, _ = query.shape
        mask = attention_mask.bool()
        if key.shape[2] > mask.shape[1]:  # static cache longer than the mask
            key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
            if kwargs.get("position_bias") is not None:  # (a bias over every slot: its keys' columns)
                kwargs = dict(kwargs, position_bias=kwargs["position_bias"][..., :mask.shape[1]])
        sk = key.shape[2]
        i = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=query.device)[None, :]
        vis = mask[:, None, None, :].expand(b, 1, sq, sk)
        if causal:
            vis = vis & (j <= i)
        if sliding_window is not None and sk > sliding_window:
            vis = vis & (j >= i - (sliding_window - 1)) & (j <= i + (sliding_window - 1))
        empty = ~vis.any(dim=-1, keepdim=True)
        out, _ = sdpa_attention_forward(module, query, key, value, vis | empty, dropout=dropout,
                                        scaling=scaling, is_causal=False, **kwargs)
        return out.masked_fill(empty[:, 0, :, :, None], 0), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=causal, **kwargs)


def hf_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """A transformers attention function (``AttentionInterface``) running cuflash.

    query (batch, nheads, q_len, d), key/value (batch, nheads_k, kv_len, d) -> (attn_output
    (batch, q_len, nheads, d), None). Masks come from transformers' flash-attention mask
    function (registered with the backend): None when there is no padding, else a (batch, kv_len)
    padding mask, run through ``attention_varlen``.
    """
    if kwargs.get("output_attentions", False):
        _warn_once("output_attentions", "cuflash backend does not return attention weights "
                   "(output_attentions=True); they are None")
    b, h, sq, d = query.shape
    sk = key.shape[2]
    if kwargs.get("position_bias") is not None:  # (T5's relative position bias: an additive score bias)
        causal = _is_causal(module, is_causal) and sq > 1
        if attention_mask is None and causal and sk > sq:  # (bottom-right over a cache: the 2D mask's rule)
            attention_mask = torch.ones(b, sk, dtype=torch.bool, device=query.device)
        return _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                              float(softcap) if softcap else 0.0, causal, _fwd_kwargs(kwargs),
                              "position_bias (an additive score bias) is not supported")
    # Llama 4's chunked layers see only the keys of their own chunk of attention_chunk_size
    # tokens. A call whose keys are its own queries (no cache before them: training, a first
    # prefill) runs with attention_chunk, the chunks counted from each sequence's first token
    # (as transformers counts them past left padding). Over a cache, the positions do not reach
    # this function (a chunked layer's cache keeps chunk - 1 tokens), so the mask function
    # (_chunk_mask) says what a step sees: a one-token step's row of keys, transformers' 4D mask
    # for several tokens (through SDPA below), or a mask tagged as needing no chunk cut while
    # every position lies in the first chunk. Any other call over `chunk` keys or more is
    # refused rather than attending across chunks.
    chunk = _layer_chunk(module)
    seen = attention_mask.shape[-1] if attention_mask is not None else sk  # (not a static cache's length)
    exact = getattr(attention_mask, "_cuflash_exact", False) or (attention_mask is not None
                                                                 and attention_mask.dim() == 4)
    if chunk and seen >= chunk and sq != seen and not exact:
        raise NotImplementedError(f"cuflash backend: chunked attention (config.attention_chunk_size={chunk}) "
                                  f"over {seen} keys with {sq} new tokens is not supported (the layer's cache "
                                  f"does not say where a chunk starts); calls without a cache (training, a first "
                                  f"prefill), one-token steps (with the mask function of register_transformers) "
                                  f"and sequences of fewer than {chunk} tokens run")
    if query.dtype == torch.float32:  # as transformers' flash backend (get_target_dtype)
        dt = _target_dtype(query, module)
        if dt in (torch.float16, torch.bfloat16):
            query, key, value = query.to(dt), key.to(dt), value.to(dt)
    v_head_dim = value.shape[-1]
    if v_head_dim < d:  # e.g. MLA: pad V to the query head dim, crop the output
        value = torch.nn.functional.pad(value, [0, d - v_head_dim])
    elif v_head_dim > d:  # a wider V: q and k padded with zeros (the same scores, at the true d's scale)
        scaling = d ** -0.5 if scaling is None else scaling
        query, key = (torch.nn.functional.pad(x, [0, v_head_dim - d]) for x in (query, key))
        d = v_head_dim

    causal = _is_causal(module, is_causal)
    causal = causal and sq > 1  # one query row, aligned bottom-right, sees every key
    # transformers' flash convention: a window of `sliding_window` tokens including the current
    # one is flash-attn's window_size=(sliding_window - 1, sliding_window - 1)
    window = (sliding_window - 1, sliding_window - 1) if (
        sliding_window is not None and sk > sliding_window) else (-1, -1)
    cap = float(softcap) if softcap else 0.0
    det = kwargs.get("deterministic")  # (transformers' default: FLASH_ATTENTION_DETERMINISTIC=1)
    det = bool(det) if det is not None else os.getenv("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    feats = dict(causal=causal, softmax_scale=scaling, window_size=window, softcap=cap,
                 deterministic=det)
    if chunk and seen >= chunk and sq == seen:
        feats["attention_chunk"] = chunk
    if getattr(attention_mask, "_cuflash_none", False):  # (every key of the first chunk: no mask)
        attention_mask = None
    if kwargs.get("s_aux") is not None:  # attention sinks (gpt-oss), one logit per query head
        feats["sinks"] = kwargs["s_aux"]
    if dropout:  # transformers passes the module's attention_dropout in training, 0.0 in eval
        if "sinks" in feats:
            raise NotImplementedError(f"cuflash backend: attention dropout ({dropout}) with attention sinks (s_aux) "
                                      "is not supported; use attention_dropout=0.0")
        # flash-attn's attention dropout, its seed and offset from torch's CUDA generator
        feats["dropout_p"] = float(dropout)

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # views
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    position_ids = kwargs.get("position_ids")

    if attention_mask is not None and attention_mask.dim() != 2:
        why = ("several new tokens over a chunked layer's cache (cuflash counts chunks from its first key)"
               if getattr(attention_mask, "_cuflash_chunks", False) else "a prepared 4D attention mask is not supported")
        return _crop(_sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling,
                                    sliding_window, cap, causal, _fwd_kwargs(kwargs), why), v_head_dim)

    if attention_mask is not None:  # padding: unpad, run varlen, pad back
        mask = attention_mask
        if k.shape[1] > mask.shape[1]:  # a static cache longer than the tokens seen
            k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
        kv_len = k.shape[1]
        idx_k, cu_k, max_k = _mask_memo.get(mask, None, _unpad_data)
        k_u, v_u = _gather_rows(k, idx_k, kv_len), _gather_rows(v, idx_k, kv_len)
        if sq == 1 or (not causal and window == (-1, -1)):
            # A decode step, or attention without a causal mask or window (an encoder's, or
            # cross-attention, whose queries are not the keys' positions): the mask is the keys';
            # every query row is computed, as SDPA does.
            idx_q = None
            cu_q, max_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device), sq
            q_u = q.reshape(b * sq, h, d)
        elif sq == kv_len:
            idx_q, cu_q, max_q = idx_k, cu_k, max_k
            q_u = _gather_rows(q, idx_q, sq)
        else:  # queries are the last sq positions (left padding)
            idx_q, cu_q, max_q = _mask_q_memo.get(mask, sq, lambda m: _unpad_data(m[:, -sq:]))
            q_u = _gather_rows(q, idx_q, sq)
        o_u = attention_varlen(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, **feats)
        if idx_q is None:
            out = o_u.view(b, sq, h, d)
        else:
            out = o_u.new_zeros((b * sq, h, d)).index_copy(0, idx_q, o_u).view(b, sq, h, d)
        return _crop((out, None), v_head_dim)

    packed = None
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        packed = (cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))
    elif position_ids is not None and b == 1 and sq > 1 and sq == sk:
        pk = _posid_memo.get(position_ids, None, _packed_data)
        if pk is not None:
            packed = (pk[0], pk[0], pk[1], pk[1])
    if packed is not None:  # several sequences packed in one row: each attends on its own
        o = attention_varlen(q.reshape(b * sq, h, d), k.reshape(b * sk, k.shape[2], d),
                             v.reshape(b * sk, v.shape[2], d), *packed, **feats)
        return _crop((o.view(b, sq, h, d), None), v_head_dim)

    out = attention(q, k, v, **feats)
    return _crop((out, None), v_head_dim)


def _is_causal(module, is_causal) -> bool:
    """The call's is_causal, else the module's; a module that does not say (no is_causal: in
    transformers only encoders of BERT's kind, ALIGN's and CLAP's text towers, LayoutLM, MarkupLM,
    Splinter) attends both ways."""
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))


def _target_dtype(query, module):
    """The dtype transformers' flash backend runs float32 queries in: autocast's, a quantized
    model's config.dtype (float32 activations around 4/8-bit weights, as QLoRA), else the dtype of
    the module's first Linear weight (layer norms kept in float32 by PEFT)."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    config = getattr(module, "config", None)
    if hasattr(config, "_is_quantized"):
        return getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return next((m.weight.dtype for m in module.modules() if isinstance(m, torch.nn.Linear)), None)


def _layer_chunk(module) -> int:
    """config.attention_chunk_size where the module's layer is chunked (config.layer_types says
    "chunked_attention" at its layer_idx; without layer_types, Llama 4's rule: the layers with
    RoPE, config.no_rope_layers[idx] == 1; without either, any module of such a config), else 0."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        return 0
    idx = getattr(module, "layer_idx", None)
    for name, chunked in (("layer_types", "chunked_attention"), ("no_rope_layers", 1)):
        marks = getattr(config, name, None)
        if marks is not None and isinstance(idx, int) and 0 <= idx < len(marks):
            return int(chunk) if marks[idx] == chunked else 0
    return int(chunk)


def _chunk_mask(*args, **kwargs):
    """transformers' mask function for cuflash: its flash-attention one (None without padding,
    else the 2D padding mask; a static cache's slots past the tokens seen masked when no
    attention_mask says so), except on a chunked layer (local_size =
    config.attention_chunk_size) whose queries reach past the first chunk, over a cache: a
    one-token step gets its row of visible keys (its chunk's, padding included) as a 2D
    (batch, kv_length) key mask; several new tokens get the 4D (batch, 1, q_length, kv_length)
    mask (run through PyTorch SDPA: cuflash cannot place chunks over a cache whose keys do not
    start at position 0). Both are transformers' own sdpa mask (its chunk rule, left padding,
    offsets). A chunked layer's masks that need no chunk cut (those rows; any mask while every
    position lies in the first chunk, None given as all keys) are tagged ``_cuflash_exact`` for
    hf_attention_forward."""
    from transformers.masking_utils import flash_attention_mask, sdpa_mask
    if args:  # (transformers passes keywords; anything else gets its flash mask)
        return flash_attention_mask(*args, **kwargs)
    config, local = kwargs.get("config"), kwargs.get("local_size")
    q_length, q_offset = kwargs.get("q_length"), kwargs.get("q_offset", 0)
    kv_offset, kv_length = kwargs.get("kv_offset", 0), kwargs.get("kv_length", q_length)
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = bool(chunk) and local == chunk and isinstance(q_length, int)
    # (q_offset may be a tensor (static caches): then not known to lie in the first chunk)
    first_chunk = chunked and isinstance(q_offset, int) and q_offset + q_length <= chunk  # (padding moves chunks later)
    if chunked and not first_chunk and (q_length == 1 or kv_offset > 0 or kv_length != q_length):
        mask = sdpa_mask(**dict(kwargs, allow_is_causal_skip=False))
        if q_length != 1:
            mask._cuflash_chunks = True
            return mask
        rows = mask[:, 0, -1, :]  # (batch, kv_length): True where the step sees the key
        rows._cuflash_exact = True
        return rows
    # (a bidirectional mask, e.g. cross-attention over a longer encoder output, is never a cache's)
    bidirectional = "allow_is_bidirectional_skip" in kwargs or getattr(kwargs.get("mask_function"), "__name__", "") \
        == "bidirectional_mask_function"
    if getattr(kwargs.get("attention_mask"), "_cuflash_keep", False):  # (an outer model's mask call decided)
        return kwargs["attention_mask"]
    composed = _composed_mask(kwargs, bidirectional)
    if composed is not None:
        return composed
    mask = flash_attention_mask(**kwargs)
    if (mask is None and not bidirectional and kwargs.get("attention_mask") is None and isinstance(kv_offset, int)
            and kv_offset == 0
            and isinstance(q_length, int) and isinstance(kv_length, int) and kv_length > q_length
            and not (isinstance(q_offset, int) and q_offset + q_length >= kv_length)):
        # A static cache: its slots past the tokens seen are no keys. As transformers' flash
        # masks, a mask of the tokens seen, whose length cuts the keys; where that count is a
        # device tensor (q_offset), a one-token step's key mask over every slot, and several
        # tokens transformers' 4D mask (through SDPA: counting the slots would need a sync).
        b, dev = kwargs.get("batch_size", 1), kwargs.get("device")
        if isinstance(q_offset, int):
            mask = torch.ones(b, q_offset + q_length, dtype=torch.bool, device=dev)
        elif q_length == 1:
            mask = (torch.arange(kv_length, device=dev) < q_offset + q_length).repeat(b, 1)  # (contiguous: tags stay)
        else:
            return sdpa_mask(**dict(kwargs, allow_is_causal_skip=False))
    if first_chunk:
        if mask is None:
            mask = torch.ones(kwargs.get("batch_size", 1), kv_length, dtype=torch.bool, device=kwargs.get("device"))
            mask._cuflash_none = True
        mask._cuflash_exact = True
    return mask


def _composed_mask(kwargs, bidirectional):
    """For a prefill whose mask transformers composed from more than padding, causality and a window
    (or/and mask functions, blockwise overlays: Gemma 3's image blocks, PaliGemma's prefix), or made
    causal for modules that say is_causal=False (PaliGemma's language model): transformers' 4D mask
    where it differs from what hf_attention_forward runs from the flash mask (the padding, the
    modules' causality, the window: the mask's local_size, or else, for an and-composed window, the
    config's sliding_window), which then goes through SDPA; where it is the same but the modules
    are not causal, the padding mask tagged to be kept as it is (a nested model's own mask call
    would make it causal); else None (the flash mask). Only such flagged calls compare, a few query
    rows of the mask at a time (at most 16M elements built at once; one host read per piece);
    packed sequences found from position_ids are not flagged (hf_attention_forward finds them), nor
    is an overlay composed with them."""
    config, q_length, kv_length = kwargs.get("config"), kwargs.get("q_length"), kwargs.get("kv_length")
    q_offset, kv_offset, b = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0), kwargs.get("batch_size", 1)
    both_ways = getattr(config, "use_bidirectional_attention", None)  # (Gemma 4: "all", "vision" or None)
    causal = not bidirectional and not (both_ways is True or both_ways == "all")
    flagged = kwargs.get("use_vmap") or getattr(kwargs.get("mask_function"), "__name__", "") == "or_mask" or (
        not bidirectional and not causal)
    if not flagged or torch.compiler.is_compiling() or not all(
            isinstance(x, int) for x in (q_length, kv_length, q_offset, kv_offset, b)) or not 1 < q_length <= kv_length:
        return None
    from transformers.masking_utils import sdpa_mask

    def mask(q0=0, n=q_length):  # transformers' 4D mask of query rows q0 .. q0 + n - 1
        return sdpa_mask(**dict(kwargs, q_offset=q_offset + q0, q_length=n, allow_is_causal_skip=False,
                                allow_is_bidirectional_skip=False))
    am = kwargs.get("attention_mask")
    if am is not None and (am.dim() != 2 or am.shape[1] != kv_length):
        return mask()  # (another layout, a static cache's slots: transformers' own mask, through SDPA)
    dev = kwargs.get("device") or (am.device if am is not None else "cpu")
    pad = torch.ones(b, kv_length, dtype=torch.bool, device=dev) if am is None else am.bool()
    # the windows it may be: the mask's, else none or (an and-composed one) the config's
    windows = [kwargs.get("local_size")] if kwargs.get("local_size") else [None, getattr(config, "sliding_window", None)]
    windows = windows[:1] + [w for w in windows[1:] if w]
    j = torch.arange(kv_offset, kv_offset + kv_length, device=dev)[None, :]
    step = max(1, (1 << 24) // max(1, b * kv_length))
    for q0 in range(0, q_length, step):
        n = min(step, q_length - q0)
        got = mask(q0, n)
        if got is None or got.dim() != 4:
            return mask()
        i = torch.arange(q_offset + q0, q_offset + q0 + n, device=dev)[:, None]
        want = pad[:, None, :].expand(b, n, kv_length)
        if causal:
            want = want & (j <= i)
        rows = pad[:, kv_length - q_length + q0:kv_length - q_length + q0 + n, None]  # (padded rows not compared)
        def same(w):  # got equals what cuflash runs with window w (None: none), on the unpadded rows
            seen = want if not w else want & ((j > i - w) if causal else ((i - j).abs() < w))
            return bool(((got[:, 0] == seen) | ~rows).all())
        windows = [w for w in windows if same(w)]
        if not windows:
            return mask()
    if causal:
        return None
    keep = pad.clone()
    keep._cuflash_keep = True
    if am is None or bool(pad.all()):
        keep._cuflash_none = True
    return keep


def _fwd_kwargs(kwargs):
    return {n: x for n, x in kwargs.items() if n not in ("sliding_window", "softcap")}


def _crop(res, v_head_dim):
    out, w = res
    return (out[..., :v_head_dim] if out.shape[-1] != v_head_dim else out), w


HF_NAME = "cuFlash"


def register_transformers(name: str = HF_NAME) -> str:
    """Register cuflash as the transformers attention implementation ``name`` (default
    ``"cuFlash"``), with transformers' flash-attention mask function (None without padding, else
    a 2D padding mask; _chunk_mask says what else chunked layers and static caches get). Then
    ``from_pretrained(..., attn_implementation="cuFlash")`` or
    ``model.set_attn_implementation("cuFlash")``. Returns ``name``.

    The name must not contain the lowercase substring "flash": transformers takes any such
    implementation name for a flash-attn build and tries to load one (from the flash_attn
    package or a hub kernel repository) when a model is created with it.
    """
    if "flash" in name:
        raise ValueError(f"transformers treats attention implementations whose name contains "
                         f"'flash' as flash-attn builds and tries to load one for {name!r}; "
                         f"register cuflash under another name (default {HF_NAME!r})")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, _chunk_mask)
    return name
