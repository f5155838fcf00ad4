"""The transformers backend on vision-language models: small random models (a vision tower and a
language model) on the cuflash backend against the same weights on transformers' eager attention,
fed images laid out as each model's processor lays them out (its image token, the right number
of them, tiny images). Checked: the logits of a batch of two rows, one left-padded, and of the
unpadded row alone (no mask), and a few greedy tokens (a KV cache). Covered: Qwen2-VL, Qwen2.5-VL
and Qwen3-VL (M-RoPE, packed rows of images, the vision tower's per-image calls, Qwen2.5-VL's
windows), LLaVA (CLIP), Idefics3 / SmolVLM (a padded image's patch
mask), Idefics2 (a perceiver's cross-attention), Gemma 3 and PaliGemma (image / prefix tokens that
attend bidirectionally through token_type_ids), mllama (cross-attention layers, 4D masks through
the SDPA fallback). On the CPU cuflash's kernels are replaced by the reference
(test_torch_integration.ref_kernels)."""
import pytest

from test_torch_integration import ref_kernels, requires_transformers  # noqa: F401 (a fixture)

torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
IMG, VID, V_START, V_END = 500, 501, 502, 503  # image, video, vision start/end tokens


def _models(name, config, **extra):
    """(cuflash model, eager model) of transformers class ``name`` from ``config`` (a
    PreTrainedConfig built twice by the callable), the same random weights."""
    import transformers
    import cuflash.torch as ct
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    ct.register_transformers()
    models = []
    for attn in ("cuFlash", "eager"):
        torch.manual_seed(0)
        models.append(getattr(transformers, name)._from_config(config(), attn_implementation=attn,
                                                               **extra).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


def _text(n, seed):
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _batch(rows):
    """Rows of token ids, left-padded with 0 to the longest: (input_ids, attention_mask, pads)."""
    n = max(len(r) for r in rows)
    pads = [n - len(r) for r in rows]
    ids = torch.tensor([[0] * p + r for p, r in zip(pads, rows)])
    mask = torch.ones_like(ids)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
    return ids, mask, pads


def _last_row(inputs, **over):
    """The inputs of the batch's last row alone (unpadded: no attention mask), ``over`` replacing
    some (the inputs without a batch dimension)."""
    one = {k: v[-1:] for k, v in inputs.items() if k != "attention_mask"}
    return dict(one, **over)


def _compare(a, b, inputs, pads, single=None, new_tokens=6):
    """The logits of the unpadded positions, then ``new_tokens`` greedy tokens, equal eager's; the
    same for ``single`` (the inputs of one unpadded row: no mask) where given."""
    with torch.no_grad():
        for inp, rows in ((inputs, pads), (single, [0])):
            if inp is None:
                continue
            la, lb = a(**inp).logits, b(**inp).logits
            for row, p in enumerate(rows):
                torch.testing.assert_close(la[row, p:], lb[row, p:], rtol=1e-4, atol=1e-4)
            if new_tokens:
                ta = a.generate(**inp, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                tb = b.generate(**inp, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                assert torch.equal(ta, tb), (ta, tb)


# ---------------------------------------------------------------------------------------------
# Qwen2-VL, Qwen2.5-VL, Qwen3-VL: M-RoPE (3-D positions), a vision tower over packed images

def _qwen_config(kind):
    import transformers
    vision = dict(depth=2, num_heads=2, in_channels=3, patch_size=2, spatial_merge_size=2, temporal_patch_size=2)
    text = dict(TEXT)
    if kind == "qwen2_vl":
        cls = "Qwen2VLConfig"
        vision.update(embed_dim=32, hidden_size=64)
        text.update(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
    elif kind == "qwen2_5_vl":
        cls = "Qwen2_5_VLConfig"
        # block 0 windowed (window_size 8 pixels: windows of 2x2 merged patches), block 1 full
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=8,
                      fullatt_block_indexes=[1])
        text.update(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
    else:
        cls = "Qwen3VLConfig"
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=64, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        text.update(head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                      mrope_section=[2, 3, 3], mrope_interleaved=True))
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")

    def config():
        return getattr(transformers, cls)(text_config=dict(text), vision_config=dict(vision), image_token_id=IMG,
                                          video_token_id=VID, vision_start_token_id=V_START,
                                          vision_end_token_id=V_END, tie_word_embeddings=False)
    return config


QWEN = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl": "Qwen3VLForConditionalGeneration"}


@requires_transformers
@pytest.mark.parametrize("kind", sorted(QWEN))
def test_qwen_vl_matches_eager(ref_kernels, kind):  # noqa: F811 (the fixture)
    """Two images (grids 1x8x8 and 1x8x12 patches: 16 and 24 image tokens after the 2x2 merge)
    in a batch of two rows, the first left-padded; 3-D M-RoPE positions from get_rope_index."""
    a, b = _models(QWEN[kind], _qwen_config(kind))
    grid = torch.tensor([[1, 8, 8], [1, 8, 12]])
    rows = [_text(3, 1) + [V_START] + [IMG] * 16 + [V_END] + _text(6, 2),
            _text(4, 3) + [V_START] + [IMG] * 24 + [V_END] + _text(9, 4)]
    ids, mask, pads = _batch(rows)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(5))
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                  mm_token_type_ids=(ids == IMG).int())
    _compare(a, b, inputs, pads, _last_row(inputs, pixel_values=pixels[64:], image_grid_thw=grid[1:]))
    assert ref_kernels, "cuflash was not called"


@requires_transformers
@pytest.mark.parametrize("kind", sorted(QWEN))
def test_qwen_vl_packed_matches_eager(ref_kernels, kind):  # noqa: F811 (the fixture)
    """Two sequences with an image each packed in one row, as transformers' note on packing asks:
    4-row position_ids, each sequence's text positions (restarting at 0) before its 3-D M-RoPE
    ones, no attention mask, no cache (training). Each sequence attends only to itself (cuflash:
    varlen from the text position_ids; eager: transformers' packed-sequence mask)."""
    a, b = _models(QWEN[kind], _qwen_config(kind))
    grid = torch.tensor([[1, 8, 8], [1, 8, 12]])
    seqs = [_text(3, 1) + [V_START] + [IMG] * 16 + [V_END] + _text(6, 2),
            _text(4, 3) + [V_START] + [IMG] * 24 + [V_END] + _text(9, 4)]
    pos = []
    for seq, g in zip(seqs, grid):
        ids = torch.tensor([seq])
        mrope, _ = a.model.get_rope_index(ids, mm_token_type_ids=(ids == IMG).int(), image_grid_thw=g[None])
        pos.append(torch.cat([torch.arange(len(seq)).view(1, 1, -1), mrope], 0))
    ids = torch.tensor([seqs[0] + seqs[1]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(5))
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMG).int(),
                  position_ids=torch.cat(pos, -1), use_cache=False)  # (transformers packs no rows with a cache)
    with torch.no_grad():
        la, lb = a(**inputs).logits, b(**inputs).logits
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    assert any(c[0] == "varlen" for c in ref_kernels), "the packed row did not run varlen"


# ---------------------------------------------------------------------------------------------
# A SigLIP / CLIP vision tower (bidirectional, no mask) and a causal language model

SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, image_size=16, patch_size=4, num_channels=3)


def _pixels(*shape, seed=5):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@requires_transformers
def test_llava_matches_eager(ref_kernels):  # noqa: F811 (the fixture)
    """LLaVA: a CLIP tower (16 patches and a class token, the class token dropped: 16 image tokens
    per image), a Llama language model; one image per row."""
    import transformers

    def config():
        return transformers.LlavaConfig(
            vision_config=dict(SIGLIP, model_type="clip_vision_model", projection_dim=32),
            text_config=dict(TEXT, model_type="llama"), image_token_index=IMG, image_seq_length=16,
            vision_feature_layer=-1)
    a, b = _models("LlavaForConditionalGeneration", config)
    rows = [[1] + _text(2, 1) + [IMG] * 16 + _text(3, 2), [1] + _text(6, 3) + [IMG] * 16 + _text(5, 4)]
    ids, mask, pads = _batch(rows)
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=_pixels(2, 3, 16, 16))
    _compare(a, b, inputs, pads, _last_row(inputs))
    assert ref_kernels, "cuflash was not called"


@pytest.mark.parametrize("name", ["Idefics3", "SmolVLM"])
@requires_transformers
def test_idefics3_smolvlm_matches_eager(ref_kernels, name):  # noqa: F811 (the fixture)
    """Idefics3 / SmolVLM: a SigLIP-like tower over 16x16 images (16 patches), pixel-shuffled by 2
    to 4 image tokens, laid out <fake><global-img><image>*4<fake>; the first row one image and
    left padding (its second image slot empty: dropped), the second two images, the first 8 pixels
    high (padded: a 2D patch mask in the tower's bidirectional attention)."""
    import transformers
    fake, glob = 497, 498
    vision = {k: v for k, v in SIGLIP.items() if k != "model_type"}
    mt = "idefics3_vision" if name == "Idefics3" else "smolvlm_vision"

    def config():
        return getattr(transformers, f"{name}Config")(
            vision_config=dict(vision, model_type=mt), text_config=dict(TEXT, model_type="llama"),
            image_token_id=IMG, scale_factor=2)
    a, b = _models(f"{name}ForConditionalGeneration", config)
    image = [fake, glob] + [IMG] * 4 + [fake]
    rows = [[1] + _text(2, 1) + image + _text(3, 2), [1] + _text(3, 3) + image + _text(2, 5) + image + _text(4, 4)]
    ids, mask, pads = _batch(rows)
    pixels = _pixels(2, 2, 3, 16, 16)
    pixel_mask = torch.ones(2, 2, 16, 16, dtype=torch.long)
    pixels[0, 1] = 0  # (the processor pads a row's missing images with zeros)
    pixel_mask[0, 1] = 0
    pixels[1, 0, :, 8:] = 0  # an image 8 pixels high padded to 16: half its patches masked in the tower
    pixel_mask[1, 0, 8:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, pixel_attention_mask=pixel_mask)
    _compare(a, b, inputs, pads, _last_row(inputs))
    assert ref_kernels, "cuflash was not called"


@requires_transformers
def test_idefics2_matches_eager(ref_kernels):  # noqa: F811 (the fixture)
    """Idefics2: the tower's 16 patches (half of them masked in one image: padded) resampled by a
    perceiver to 4 latents (cross-attention of 4 latent queries over the patches and the latents,
    the masked patches' keys dropped), laid out <fake><image>*4<fake>."""
    import transformers
    fake = 497
    vision = {k: v for k, v in SIGLIP.items() if k != "model_type"}

    def config():
        return transformers.Idefics2Config(
            vision_config=dict(vision), text_config=dict(TEXT, model_type="mistral", sliding_window=None),
            perceiver_config=dict(hidden_size=64, resampler_n_latents=4, resampler_depth=2, resampler_n_heads=2,
                                  resampler_head_dim=16, num_key_value_heads=1),
            image_token_id=IMG)
    a, b = _models("Idefics2ForConditionalGeneration", config)
    image = [fake] + [IMG] * 4 + [fake]
    rows = [[1] + _text(2, 1) + image + _text(3, 2), [1] + _text(3, 3) + image + _text(2, 5) + image + _text(4, 4)]
    ids, mask, pads = _batch(rows)
    pixels = _pixels(2, 2, 3, 16, 16)
    pixel_mask = torch.ones(2, 2, 16, 16, dtype=torch.long)
    pixels[0, 1] = 0
    pixel_mask[0, 1] = 0
    pixels[1, 0, :, 8:] = 0
    pixel_mask[1, 0, 8:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, pixel_attention_mask=pixel_mask)
    _compare(a, b, inputs, pads, _last_row(inputs))
    assert any(c[0] == "varlen" and c[1][0] == 3 * 4 for c in ref_kernels), "no perceiver call (4 latents, 3 images)"


# ---------------------------------------------------------------------------------------------
# Gemma 3 and PaliGemma: image tokens (PaliGemma: the whole prefix) attend bidirectionally

def _gemma3_config():
    import transformers
    return transformers.Gemma3Config(
        vision_config=dict(SIGLIP), mm_tokens_per_image=4, boi_token_index=498, eoi_token_index=499,
        image_token_index=IMG,
        text_config=dict(TEXT, model_type="gemma3_text", head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention"]))


def _gemma3_rows():
    image = [498] + [IMG] * 4 + [499]  # <start_of_image> 4 image tokens <end_of_image>
    return [[1] + _text(2, 1) + image + _text(3, 2), [1] + _text(5, 3) + image + _text(6, 4)]


@requires_transformers
def test_gemma3_text_only_matches_eager(ref_kernels):  # noqa: F811 (the fixture)
    """Gemma 3 (the multimodal model class) without images: sliding and full layers, left padding."""
    a, b = _models("Gemma3ForConditionalGeneration", _gemma3_config)
    ids, mask, pads = _batch([[1] + _text(12, 1), [1] + _text(18, 2)])
    inputs = dict(input_ids=ids, attention_mask=mask)
    _compare(a, b, inputs, pads, _last_row(inputs))
    assert ref_kernels, "cuflash was not called"


@requires_transformers
def test_gemma3_token_types_without_images_stay_on_cuflash(ref_kernels, recwarn):  # noqa: F811 (the fixture)
    """Gemma 3 with the processor's token_type_ids and no image, over more tokens than the sliding
    window: transformers composes the masks (an image-block overlay, the window as an and-mask),
    which agree with what cuflash runs, so every layer (sliding and full) stays on cuflash, with
    eager's logits."""
    a, b = _models("Gemma3ForConditionalGeneration", _gemma3_config)
    ids, mask, pads = _batch([[1] + _text(12, 1), [1] + _text(18, 2)])
    inputs = dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
    _compare(a, b, inputs, pads, _last_row(inputs))
    assert not [w for w in recwarn if "SDPA" in str(w.message)], "a layer went through the SDPA fallback"
    assert ref_kernels, "cuflash was not called"


@requires_transformers
def test_gemma3_images_match_eager(ref_kernels):  # noqa: F811 (the fixture)
    """Gemma 3 with one image per row (16 SigLIP patches pooled to 4 image tokens): token_type_ids
    make each image's tokens attend to each other bidirectionally. transformers' own flash backend
    refuses this model (_supports_flash_attn = False: it would drop that mask); cuflash gives
    eager's logits (transformers' 4D mask through SDPA where it is not one cuflash runs)."""
    a, b = _models("Gemma3ForConditionalGeneration", _gemma3_config)
    ids, mask, pads = _batch(_gemma3_rows())
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=_pixels(2, 3, 16, 16),
                  token_type_ids=(ids == IMG).long())
    _compare(a, b, inputs, pads, _last_row(inputs))


@requires_transformers
@pytest.mark.parametrize("layout", ["prompt", "prompt_and_suffix", "no_token_types"])
def test_paligemma_matches_eager(ref_kernels, layout):  # noqa: F811 (the fixture)
    """PaliGemma: 16 image tokens, <bos>, a prompt, "\\n" (the processor's layout). The prefix (all of
    a prompt: token_type_ids 0) attends bidirectionally, a suffix (token_type_ids 1, in training)
    causally; without token_type_ids eager attends causally (the language model's modules say
    is_causal=False: the mask says causal). transformers' flash backend refuses the model;
    cuflash gives eager's logits (through SDPA where the mask is not one cuflash runs)."""
    import transformers

    def config():
        return transformers.PaliGemmaConfig(
            vision_config=dict(SIGLIP, projection_dim=64), image_token_index=IMG, projection_dim=64,
            text_config=dict(TEXT, model_type="gemma", head_dim=16), vocab_size=512, hidden_size=64)
    a, b = _models("PaliGemmaForConditionalGeneration", config)
    prefix = [[IMG] * 16 + [1] + _text(3, 1) + [10], [IMG] * 16 + [1] + _text(7, 2) + [10]]
    suffix = [_text(4, 3), _text(2, 4)] if layout == "prompt_and_suffix" else [[], []]
    ids, mask, pads = _batch([p + s for p, s in zip(prefix, suffix)])
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=_pixels(2, 3, 16, 16))
    if layout != "no_token_types":
        inputs["token_type_ids"] = torch.zeros_like(ids)
        for row, s in enumerate(suffix):
            inputs["token_type_ids"][row, ids.shape[1] - len(s):] = 1 if s else 0
    _compare(a, b, inputs, pads, _last_row(inputs), new_tokens=0 if suffix[0] else 6)


# ---------------------------------------------------------------------------------------------
# mllama: a tiled vision tower (aspect-ratio 4D masks), cross-attention layers

@requires_transformers
def test_mllama_matches_eager(ref_kernels):  # noqa: F811 (the fixture)
    """Mllama: one image per row (row 0 in 1 tile of its 2, row 1 in 2); layer 1 cross-attends to
    the image's tiles through a 4D cross-attention mask, layers 0 and 2 are causal self-attention
    (cuflash). The 4D masks (cross-attention, the tower's aspect-ratio mask) go through the SDPA
    fallback, as transformers' flash backend refuses them (_supports_flash_attn = False)."""
    import transformers

    def config():
        return transformers.MllamaConfig(
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=2, image_size=16, patch_size=4, max_num_tiles=2,
                               intermediate_layers_indices=[0], vision_output_dim=64,
                               supported_aspect_ratios=[[1, 1], [1, 2]]),
            text_config=dict(TEXT, num_hidden_layers=3, cross_attention_layers=[1], rope_parameters=None),
            image_token_index=IMG)
    a, b = _models("MllamaForConditionalGeneration", config)
    rows = [[1, IMG] + _text(8, 1), [1, IMG] + _text(14, 2)]
    ids, mask, pads = _batch(rows)
    cross = torch.zeros(2, ids.shape[1], 1, 2, dtype=torch.long)
    for row, p in enumerate(pads):
        cross[row, p + 1:, 0, :1 + row] = 1  # from the image token on, its tiles
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=_pixels(2, 1, 2, 3, 16, 16),
                  aspect_ratio_ids=torch.tensor([[1], [2]]), aspect_ratio_mask=torch.tensor([[[1, 0]], [[1, 1]]]),
                  cross_attention_mask=cross)
    _compare(a, b, inputs, pads, _last_row(inputs))
    assert ref_kernels, "cuflash was not called"


@requires_transformers
def test_gemma4_bidirectional_setting_is_read_as_its_modules_read_it():
    """Gemma 4's use_bidirectional_attention is "all", "vision" or None: with "vision" the text
    layers stay causal (a plain causal mask call is not checked: None, the flash mask); with "all"
    a causal mask for them differs from what they run and goes through SDPA (the 4D mask)."""
    import types
    from transformers.masking_utils import causal_mask_function
    from cuflash.torch import hf
    kw = dict(config=types.SimpleNamespace(use_bidirectional_attention="vision"), batch_size=1, q_length=8,
              kv_length=8, q_offset=0, kv_offset=0, mask_function=causal_mask_function, attention_mask=None,
              device="cpu", allow_is_causal_skip=True)
    assert hf._composed_mask(kw, False) is None
    kw["config"].use_bidirectional_attention = "all"
    assert hf._composed_mask(kw, False).shape == (1, 1, 8, 8)
