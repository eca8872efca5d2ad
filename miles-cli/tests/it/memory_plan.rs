//! The memory plan `miles train` prints at start and sizes the engine's KV pool from, at the
//! Qwen3-0.6B shape (issue 46: a real 0.6B step takes minutes, so the test checks the
//! accounting that keeps it inside the machine; the bench's `qwen3_0_6b` rows run it).
//! Every expected figure is computed here from the config by hand.
//!
//! `miles train` releases the engine's weights and KV pool while it trains by default
//! (`--offload-rollout`); `--no-offload-rollout` (and `train-async`) keep them.

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
    qwen3_0_6b_offload(engine_dtype_bytes, kv_tokens, false, false)
}

fn qwen3_0_6b_offload(
    engine_dtype_bytes: u64,
    kv_tokens: u64,
    offload_weights: bool,
    offload_kv_cache: bool,
) -> MemoryInputs {
    MemoryInputs {
        params: QWEN3_0_6B_PARAMS,
        layers: 28,
        hidden: 1_024,
        intermediate: 3_072,
        heads: 16,
        q_width: 16 * 128,
        kv_width: 8 * 128,
        engine_dtype_bytes,
        // An engine that copies every weight for decoding (packed panels with AVX-512F;
        // with AVX2 only, a dense model has none: see below).
        engine_decode_copy_params: QWEN3_0_6B_PARAMS,
        offload_weights,
        offload_kv_cache,
        kv_tokens,
        // 28 layers × 8 KV heads × 128 channels × keys and values.
        kv_bytes_per_token: 28 * 8 * 128 * 2 * engine_dtype_bytes,
        // The bench's batch: 4 prompts × 8 samples in one padded micro-batch of 48 tokens.
        micro_batch_seqs: 32,
        seq_len: 48,
    }
}

#[test]
fn a_qwen3_0_6b_step_without_offload_fits_in_24_gib_with_headroom() {
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
            offloaded: 0,
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
fn offloading_the_rollout_drops_the_previous_version_and_the_decode_copies_while_training() {
    // `miles train`'s default: the engine releases its weights (served version and decode
    // copies) and its KV pool for the training step and takes them back at the push.
    let plan = MemoryPlan::new(&qwen3_0_6b_offload(4, 4_096, true, true));
    // No previous version: AdamW updates the trainer's buffers in place.
    assert_eq!(plan.engine_version, 0);
    assert_eq!(plan.engine_decode_copies, 2_384_199_680);
    // Released for training: the decode copies and the 4,096-token pool.
    assert_eq!(plan.offloaded, 2_384_199_680 + 939_524_096);
    // Held throughout: the trainer's weights, gradients and two moments (4 f32 copies).
    assert_eq!(plan.resident(), 4 * 2_384_199_680);
    // Training: resident + activations (15,085,862,912); generation / push: resident + the
    // engine's decode copies and pool (12,860,522,496): the peak is the training pass's,
    // 3,323,723,776 bytes (3.10 GiB) under the plan without offload (18,409,586,688).
    assert_eq!(plan.peak(), 9_536_798_720 + 5_549_064_192);
    assert_eq!(plan.trainer_growth(), 2_384_199_680 + 4_768_399_360);
    let line = plan.line(None);
    assert!(line.contains("peak 14.05"), "{line}");
    assert!(line.contains("releases 3.10"), "{line}");

    // Weights only (`--offload-rollout-level weight`): the pool stays.
    let weights_only = MemoryPlan::new(&qwen3_0_6b_offload(4, 4_096, true, false));
    assert_eq!(weights_only.offloaded, 2_384_199_680);
    assert_eq!(weights_only.peak(), 10_476_322_816 + 5_549_064_192);
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

#[test]
fn a_dense_engine_reading_the_trainers_weights_in_place_holds_no_decode_copies() {
    // Flex in f32 with AVX2 and no AVX-512F: the engine multiplies the weights it serves where they lie,
    // so a dense model's plan has no decode copies. `train-async` (no offload) then holds the
    // trainer's weights, gradients and moments, the pool, and from the AdamW step to the push
    // the engine's previous version: 5 weight-sized f32 copies instead of 6.
    let mut inputs = qwen3_0_6b(4, 4_096);
    inputs.engine_decode_copy_params = 0;
    let plan = MemoryPlan::new(&inputs);
    assert_eq!(plan.engine_decode_copies, 0);
    assert_eq!(plan.engine(), 939_524_096);
    assert_eq!(plan.resident(), 4 * 2_384_199_680 + 939_524_096);
    // The training step's activations (5,549,064,192) exceed the previous version.
    assert_eq!(plan.peak(), 4 * 2_384_199_680 + 939_524_096 + 5_549_064_192);
    // With offload nothing but the pool is released.
    inputs.offload_weights = true;
    inputs.offload_kv_cache = true;
    assert_eq!(MemoryPlan::new(&inputs).offloaded, 939_524_096);
}
