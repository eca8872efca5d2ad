"""HF transformers baseline for `miles-engine/benches/engine_decode.rs`: greedy `generate` and a
prefill forward on the model directory the Rust bench exported (the same random weights), on the
CPU with 2 threads, float32 (or `--dtype bfloat16` / `float16`: the engine's precision). For a Qwen3.5 model (Gated DeltaNet layers) transformers runs its
PyTorch-only fallbacks on the CPU (flash-linear-attention and causal-conv1d are absent):
`torch_chunk_gated_delta_rule` in the prefill, `torch_recurrent_gated_delta_rule` and
`causal_conv1d_update`'s torch form for each decoded token.

Usage: python hf_generate.py --model-dir DIR --name NAME [--seqs 1,8,32] [--new-tokens 256]
                             [--prompt-len 16] [--prefill-seqs 32] [--prefill-len 512]
                             [--dtype float32]
Prints, per row, `hf-result: <name> decode seqs=<n> tokens_per_s=<x> secs=<s>`, then
`hf-result: <name> prefill tokens_per_s=<x> secs=<s>`, `hf-result: <name> peak_rss_mib=<m>`
and `hf-tokens: <name> seqs=<n> ids=<comma list>` (row 0 of the largest decode batch, so the
bench can say how far the two greedy outputs agree). Needs torch and transformers.

Prompts follow the Rust bench's formula: token t of prompt i is (t*131 + i*977 + 7) % vocab.
Decode forces exactly `new_tokens` tokens (min_new_tokens = max_new_tokens, no EOS), as the
engine bench does. The prefill row is one forward over the [seqs, len] batch with
`logits_to_keep=1` (what `generate`'s own prefill computes), without a cache.
"""
import argparse
import resource
import time

import torch
import transformers


def prompt(i, length, vocab):
    return [(t * 131 + i * 977 + 7) % vocab for t in range(length)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--seqs", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--prefill-seqs", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    vocab = model.config.vocab_size
    name = args.name

    def generate(seqs, new_tokens):
        ids = torch.tensor([prompt(i, args.prompt_len, vocab) for i in range(seqs)])
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                use_cache=True,
            )

    generate(2, 4)  # warm-up
    last = None
    for seqs in [int(s) for s in args.seqs.split(",") if s]:
        start = time.perf_counter()
        out = generate(seqs, args.new_tokens)
        secs = time.perf_counter() - start
        produced = out.shape[0] * (out.shape[1] - args.prompt_len)
        assert produced == seqs * args.new_tokens, (produced, seqs, args.new_tokens)
        print(f"hf-result: {name} decode seqs={seqs} tokens_per_s={produced / secs:.1f} "
              f"secs={secs:.3f}", flush=True)
        last = (seqs, out[0, args.prompt_len:].tolist())
    if last is not None:
        seqs, ids = last
        print(f"hf-tokens: {name} seqs={seqs} ids={','.join(str(t) for t in ids)}", flush=True)
    if args.prefill_seqs > 0:
        ids = torch.tensor([prompt(100 + i, args.prefill_len, vocab)
                            for i in range(args.prefill_seqs)])
        with torch.inference_mode():
            model(input_ids=ids[:1, :16], logits_to_keep=1)  # warm-up
            start = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1, use_cache=False)
            secs = time.perf_counter() - start
        tokens = args.prefill_seqs * args.prefill_len
        print(f"hf-result: {name} prefill tokens_per_s={tokens / secs:.1f} secs={secs:.3f}",
              flush=True)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"hf-result: {name} peak_rss_mib={peak_kib / 1024:.0f}", flush=True)


if __name__ == "__main__":
    main()
