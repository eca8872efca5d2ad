"""PyTorch reference for `benches/train_step.rs`: the same four models and batch, trained with
HF transformers on the CPU with 2 threads (forward + causal-LM loss + backward + AdamW).

Usage: python torch_train_step.py [--iters N] [--only NAME] [--batch B --seq S] [--dtype bf16]
(needs torch, transformers). Prints one line per model:
`torch-result: <name> tokens_per_s=<x> step_s=<y> params=<n> peak_rss_mib=<m>`.
`--batch` / `--seq` override the batch (the Rust bench passes the shape it runs: 8 x 512, or
4 x 256 for the Qwen3-0.6B shape); `--dtype bf16` runs Megatron-style mixed precision: f32
master weights and AdamW, the forward and backward under `torch.autocast("cpu", bfloat16)`.
The Rust bench runs this script in the same run when a Python with torch is available
(`MILES_TORCH_PYTHON`, or `.venv-ref/bin/python` at the workspace root).
"""
import argparse
import contextlib
import resource
import time

import torch
import transformers

BATCH, SEQ = 8, 512

GLM = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
           num_hidden_layers=8, first_k_dense_replace=1, n_routed_experts=16,
           num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1,
           norm_topk_prob=True, routed_scaling_factor=1.0, num_attention_heads=8,
           num_key_value_heads=4, head_dim=64,
           rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                partial_rotary_factor=0.5),
           attention_bias=False, tie_word_embeddings=False, rms_norm_eps=1e-5,
           initializer_range=0.02)
QWEN3 = dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
             num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
             tie_word_embeddings=True, rms_norm_eps=1e-6, initializer_range=0.02)
DSV3 = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, moe_intermediate_size=224,
            num_hidden_layers=8, first_k_dense_replace=1, n_routed_experts=16,
            num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5, num_attention_heads=8,
            num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64,
            qk_rope_head_dim=32, v_head_dim=64, rope_interleave=True,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=1024, mscale=1.0,
                                 mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
            tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.02)

# Qwen3.5-MoE-style, 81 M (see train_step.rs). Without flash-linear-attention and causal-conv1d
# (none on a CPU), transformers runs `torch_chunk_gated_delta_rule` (chunks of 64) and
# `F.conv1d` in the Gated DeltaNet layers.
QWEN35_MOE = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8,
                  layer_types=["linear_attention"] * 3 + ["full_attention"]
                  + ["linear_attention"] * 3 + ["full_attention"],
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  linear_num_key_heads=4, linear_key_head_dim=64, linear_num_value_heads=8,
                  linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=16,
                  num_experts_per_tok=4, moe_intermediate_size=192,
                  shared_expert_intermediate_size=192,
                  rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                       partial_rotary_factor=0.25),
                  max_position_embeddings=4096, attention_bias=False,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.02)

# Qwen3-0.6B's shape (random weights): 28 layers, hidden 1024, 16 heads / 8 KV heads of 128,
# intermediate 3072, vocabulary 151,936, tied embeddings (596 M parameters).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                  attention_bias=False, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  initializer_range=0.02)

MODELS = {
    "glm_moe_88m": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, GLM),
    "qwen3_25m": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3),
    "deepseek_v3_82m": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, DSV3),
    "qwen35_moe_80m": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                       QWEN35_MOE),
    "qwen3_0_6b": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3_0_6B),
}


def peak_rss_mib():
    """The process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--only", default=None)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    args = parser.parse_args()
    batch, seq = args.batch, args.seq
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for name, (config_cls, model_cls, kwargs) in MODELS.items():
        if args.only and name != args.only:
            continue
        if not args.only and name == "qwen3_0_6b":
            continue  # only when named: at 8 x 512 its step does not fit in 24 GiB
        model = model_cls(config_cls(**kwargs)).float().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, kwargs["vocab_size"], (batch, seq))
        times = []
        for i in range(args.iters + 1):
            start = time.perf_counter()
            if args.dtype == "bf16":
                ctx = torch.autocast("cpu", dtype=torch.bfloat16)
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i > 0:  # the first step is a warm-up
                times.append(time.perf_counter() - start)
        step = sum(times) / len(times)
        params = sum(p.numel() for p in model.parameters())
        print(f"torch-result: {name} tokens_per_s={batch * seq / step:.1f} step_s={step:.4f} "
              f"params={params} peak_rss_mib={peak_rss_mib():.0f}", flush=True)
        del model, opt


if __name__ == "__main__":
    main()
