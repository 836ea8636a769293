"""Fine-tune a Hugging Face transformers Llama in FP8 with tpfp8, then save, reload and
generate: the whole round trip a user of transformers runs.

  1. build a Llama from a config (tiny by default; no download),
  2. tpfp8.swap_linear: every Linear but the LM head computes in FP8 inside fp8_autocast,
  3. train a few steps on next-byte prediction of a text (the bytes of a Python
     standard-library module), with gradient checkpointing on (plain torch.utils.checkpoint,
     as transformers calls it),
  4. save_pretrained, then from_pretrained + swap_linear + tpfp8.load_fp8_state,
  5. check the reloaded model's FP8 state and weights equal the trained one's, and generate.

  python examples/hf_llama_fp8.py                      # tiny, CPU or GPU, a few seconds
  python examples/hf_llama_fp8.py --hidden 1024 --layers 4 --steps 200 --recipe current
"""
import argparse
import os
import tempfile
import time

import torch
import transformers

import tpfp8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 16)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--seq", type=int, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--recipe", choices=("delayed", "current"), default="delayed",
                   help="FP8 scaling recipe")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="folder for save_pretrained (default: a "
                                               "temporary one, removed at the end)")
    return p.parse_args(argv)


def build(args) -> transformers.LlamaForCausalLM:
    """A Llama over 256 byte values whose Linears all have FP8-friendly sizes."""
    heads = max(args.hidden // 64, 2)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=heads, max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(args.device)
    # The LM head stays in high precision (a common choice: its output feeds the loss).
    return tpfp8.swap_linear(model, filter_fn=lambda _, name: name != "lm_head")


def text_bytes(limit=1 << 20) -> torch.Tensor:
    """The bytes of a standard-library module: real text that every machine has."""
    with open(os.path.join(os.path.dirname(os.__file__), "argparse.py"), "rb") as f:
        return torch.frombuffer(bytearray(f.read(limit)), dtype=torch.uint8).long()


def train(model, data, args, recipe) -> list:
    """AdamW steps on random windows of `data`, with gradient checkpointing; the losses."""
    model.train()
    # (transformers 5 renamed gradient_checkpointing_enable; both call torch's checkpoint)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=gen)
        ids = torch.stack([data[s:s + args.seq] for s in starts]).to(args.device)
        with tpfp8.fp8_autocast(recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % max(args.steps // 10, 1) == 0 or step == args.steps - 1:
            print(f"step {step + 1:4d}/{args.steps}  loss {losses[-1]:.3f}  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    return losses


def reload(folder, device) -> transformers.LlamaForCausalLM:
    """from_pretrained, the same conversion, then the FP8 state from_pretrained left out."""
    # from_pretrained reports the FP8 state's keys as unexpected (the plain model has no place
    # for them): load_fp8_state below takes them, so the report is left out.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = transformers.LlamaForCausalLM.from_pretrained(folder).to(device)
    finally:
        transformers.logging.set_verbosity(verbosity)
    tpfp8.swap_linear(model, filter_fn=lambda _, name: name != "lm_head")
    layers = tpfp8.load_fp8_state(model, folder)
    print(f"reloaded from {folder}: FP8 state of {layers} layers")
    return model


def same_state(a, b) -> bool:
    """Weights and FP8 state (scales, histories) of the two models are equal."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def main(argv=None):
    args = parse_args(argv)
    recipe = tpfp8.DelayedScaling() if args.recipe == "delayed" else tpfp8.CurrentScaling()
    model = build(args)
    print(f"Llama: {args.layers} layers, hidden {args.hidden}, "
          f"{sum(isinstance(m, tpfp8.Linear) for m in model.modules())} FP8 Linears, "
          f"{args.recipe} scaling, on {args.device}")
    losses = train(model, text_bytes(), args, recipe)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or tmp
        model.save_pretrained(folder)
        loaded = reload(folder, args.device)
        assert same_state(model, loaded), "the reloaded model differs from the trained one"
    loaded.eval()
    prompt = torch.tensor([list(b"def ")], device=args.device)
    with torch.no_grad(), tpfp8.fp8_autocast(recipe=recipe):
        out = loaded.generate(prompt, max_new_tokens=24, do_sample=False)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; generated: {text!r}")
    return losses, text


if __name__ == "__main__":
    main()
