"""cuflash as the attention backend of a Hugging Face transformers model.

Builds a small randomly initialised Qwen2 (no download), generates greedily with cuflash and with
PyTorch SDPA from the same weights, says whether the tokens agree, and shows the plan cuflash ran
per phase: the prefill kernel, then the decode kernel as the KV cache grows, and where split-KV
(a split kernel plus a combine kernel) takes over.

    python examples/hf_generate.py [--prompt-len 120] [--new-tokens 200] [--batch 1]

Needs PyTorch with CUDA and transformers; without them it says so and exits.
"""
import argparse
import os
import sys


def tiny_qwen2_config(**over):
    from transformers import Qwen2Config
    cfg = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=128,
               max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False)
    cfg.update(over)
    return Qwen2Config(**cfg)


def build_models(cfg, name, device, dtype, seed=0):
    """The same random weights under the cuflash backend and under SDPA."""
    import copy
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    # one config object each: a model keeps (and sets the backend on) the config it is given
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name, dtype=dtype)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype)
    ref.load_state_dict(model.state_dict())
    return model.to(device).eval(), ref.to(device).eval()


def greedy(model, ids, new_tokens, mask=None):
    import torch
    with torch.no_grad():
        r = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return r.sequences, torch.stack(r.logits, dim=1).float()


def logit_step(value, dtype):
    """The spacing of ``dtype`` numbers at ``value`` (one rounding step of a logit)."""
    import math

    import torch
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(value), 1e-30)))


def compare(seq, seq_ref, logits_ref, prompt_len, dtype):
    """A line saying whether the tokens agree. At a first difference it gives SDPA's logit margin
    between the two tokens: within two rounding steps of ``dtype`` the two choices are a tie at
    that precision (greedy decoding then follows either branch)."""
    diff = (seq != seq_ref).nonzero()
    if not diff.numel():
        return f"tokens agree: {seq.shape[1] - prompt_len} new tokens x {seq.shape[0]} sequences"
    row, col = (int(x) for x in diff[0])
    step = col - prompt_len
    a, b = int(seq[row, col]), int(seq_ref[row, col])
    margin = float(logits_ref[row, step, b] - logits_ref[row, step, a])
    ulp = logit_step(float(logits_ref[row, step, b]), dtype)
    if margin <= 2 * ulp:
        return (f"tokens agree for the first {step} new tokens; at new token {step} (sequence {row}) "
                f"SDPA's own top two logits differ by {margin:.4f} = {margin / ulp:.0f} {str(dtype)[6:]} "
                f"step(s): a tie at this precision (cuflash picked {a}, sdpa {b}), after which "
                "greedy decoding follows different branches")
    return (f"tokens differ first at sequence {row}, new token {step}: cuflash {a}, sdpa {b} "
            f"(sdpa's logit margin between them: {margin:.4f}, {margin / ulp:.0f} rounding steps)")


def plan_summary(plans):
    """Lines for the recorded plans: each prefill shape, then decode grouped into runs of KV
    lengths with the same kernels and split count."""
    lines, run = [], None

    def flush():
        if run:
            (kern, splits), lo, hi = run
            span = f"seqlen_k {lo}" if lo == hi else f"seqlen_k {lo}..{hi}"
            how = f"{splits} splits + combine" if splits > 1 else "no split"
            lines.append(f"  decode   {span:18s} {' + '.join(kern)}  ({how})")

    for r in plans:
        if r.phase != "decode":
            flush()
            run = None
            lines.append(f"  {r.phase:8s} q={r.q_shape} k={r.k_shape} causal={r.causal}: "
                         f"{' + '.join(r.kernels) or '(no plan description)'}")
            continue
        sk, key = r.k_shape[1], (r.kernels, r.num_splits)
        if run and run[0] == key:
            run = (key, run[1], sk)
        else:
            flush()
            run = (key, sk, sk)
    flush()
    return lines


def run(prompt_len=120, new_tokens=200, batch=1, device="cuda", dtype="bfloat16", seed=0,
        config=None, out=print):
    import torch
    import cuflash.torch
    name = cuflash.torch.register_transformers()
    cfg = config or tiny_qwen2_config()
    model, ref = build_models(cfg, name, device, getattr(torch, dtype), seed)
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (batch, prompt_len), device=device, generator=g)
    mask = torch.ones_like(ids)  # explicit: token 0 serves as padding
    if batch > 1:  # left padding on the first sequence: padded prompts go through varlen
        mask[0, : prompt_len // 3] = 0
    out(f"Qwen2 (random weights): {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} heads, head dim {cfg.head_dim}, {dtype}, batch {batch}, "
        f"prompt {prompt_len}, {new_tokens} new tokens, greedy")
    with cuflash.torch.record_plans() as plans:
        seq, _ = greedy(model, ids, new_tokens, mask)
    seq_ref, logits_ref = greedy(ref, ids, new_tokens, mask)
    out(compare(seq, seq_ref, logits_ref, prompt_len, getattr(torch, dtype)))
    out("cuflash plans per phase:")
    for line in plan_summary(plans):
        out(line)
    return seq, seq_ref, plans


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-len", type=int, default=120)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--batch", type=int, default=1, help="> 1 left-pads the first prompt")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("This example needs PyTorch with CUDA (pip install torch); it is not installed.")
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("This example needs Hugging Face transformers (pip install transformers); "
              "it is not installed.")
        return 0
    if not torch.cuda.is_available():
        print("This example needs a CUDA GPU, and PyTorch sees none.")
        return 0
    try:
        import cuflash  # noqa: F401
    except ImportError:  # running from a checkout without installing
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    run(args.prompt_len, args.new_tokens, args.batch, dtype=args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
