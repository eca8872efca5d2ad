//! The memory plan `miles train` prints at start and sizes the engine's KV pool from, at the
//! Qwen3-0.6B shape (issue 46: a real 0.6B step takes minutes, so the test checks the
//! accounting that keeps it inside the machine; the bench's `qwen3_0_6b` rows run it).
//! Every expected figure is computed here from the config by hand.

use miles_cli::memory::{MemoryInputs, MemoryPlan};

/// Qwen3-0.6B's parameters: embeddings 151,936 × 1,024 (tied: counted once); per layer q
/// 1,024 × 2,048, k and v 1,024 × 1,024 each, o 2,048 × 1,024, q / k norms 128 each, gate /
/// up / down 1,024 × 3,072 each, two norms of 1,024; the final norm.
const QWEN3_0_6B_PARAMS: u64 = 151_936 * 1_024
    + 28 * (1_024 * 2_048
        + 2 * 1_024 * 1_024
        + 2_048 * 1_024
        + 2 * 128
        + 3 * 1_024 * 3_072
        + 2 * 1_024)
    + 1_024;

fn qwen3_0_6b(engine_dtype_bytes: u64, kv_tokens: u64) -> MemoryInputs {
    MemoryInputs {
        params: QWEN3_0_6B_PARAMS,
        layers: 28,
        hidden: 1_024,
        intermediate: 3_072,
        heads: 16,
        q_width: 16 * 128,
        kv_width: 8 * 128,
        engine_dtype_bytes,
        engine_decode_copies: true,
        kv_tokens,
        // 28 layers × 8 KV heads × 128 channels × keys and values.
        kv_bytes_per_token: 28 * 8 * 128 * 2 * engine_dtype_bytes,
        // The bench's batch: 4 prompts × 8 samples in one padded micro-batch of 48 tokens.
        micro_batch_seqs: 32,
        seq_len: 48,
    }
}

#[test]
fn a_qwen3_0_6b_step_fits_in_24_gib_with_headroom() {
    assert_eq!(QWEN3_0_6B_PARAMS, 596_049_920);
    let plan = MemoryPlan::new(&qwen3_0_6b(4, 4_096));
    assert_eq!(
        plan,
        MemoryPlan {
            trainer_weights: 2_384_199_680,
            gradients: 2_384_199_680,
            optimizer: 4_768_399_360,
            engine_version: 2_384_199_680,
            engine_decode_copies: 2_384_199_680,
            // 4,096 tokens × 229,376 bytes.
            kv_pool: 939_524_096,
            // 1,536 tokens × 28 layers × 30,720 values × 4 bytes + 32 × 16 heads × 48² × 28
            // layers × 8 bytes.
            activations: 5_284_823_040 + 264_241_152,
        }
    );
    // Resident: 4 weight-sized f32 copies (weights, gradients, two moments), the engine's
    // decode copies and the pool; the peak adds the activations (larger here than the
    // previous version the engine holds from the AdamW step to the push).
    assert_eq!(plan.resident(), 12_860_522_496);
    assert_eq!(plan.peak(), 18_409_586_688);
    let gib = 1u64 << 30;
    assert!(plan.peak() + 6 * gib < 24 * gib, "{}", plan.line(None));
    // What the engine's pool leaves to the trainer before its fraction: gradients, moments
    // and the engine's previous version (the activations live in the rest of the fraction).
    assert_eq!(
        plan.trainer_growth(),
        2_384_199_680 + 4_768_399_360 + 2_384_199_680
    );
    let line = plan.line(Some(20 * gib));
    assert!(line.contains("peak 17.15"), "{line}");
    assert!(line.contains("of 20.00 available"), "{line}");
}

#[test]
fn a_bf16_engine_halves_its_copies_and_its_pool() {
    let plan = MemoryPlan::new(&qwen3_0_6b(2, 4_096));
    assert_eq!(plan.engine_version, 1_192_099_840);
    assert_eq!(plan.engine_decode_copies, 1_192_099_840);
    assert_eq!(plan.kv_pool, 469_762_048);
    // The trainer's f32 masters, gradients and moments do not change.
    assert_eq!(
        plan.trainer_weights + plan.gradients + plan.optimizer,
        9_536_798_720
    );
}
