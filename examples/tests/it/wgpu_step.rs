//! One synchronous GRPO step end to end on `wgpu-cpu` (burn's wgpu runtime on the CPU
//! adapter: Mesa lavapipe without a GPU; the fused log-prob op and the clipped loss run as
//! CubeCL kernels there) against the same step on flex, with the tiny GLM-4-MoE fixture:
//! greedy engine rollout with routed experts recorded, trainer step with rollout routing
//! replay (R3) and TIS, in-place weight update of the engine.
//!
//! On each device: the engine's log-probs equal the trainer's bit for bit (the engine scores
//! with the trainer's function, as on flex in `engine_vs_trainer.rs`), the trainer's replayed
//! routing is the routing it computes itself on every compared token (flip rate 0), and the
//! engine serves the new version after the update. Between the devices: the same greedy tokens
//! and routed experts, and log-probs, metrics and updated weights equal to float rounding
//! (tolerances at the assertions).
//!
//! The wgpu device is created once per process (`miles_ops::kernels`), so the compiled
//! shaders stay cached for the whole test binary. Without an adapter the test prints a loud
//! `!!! KERNEL TEST … NOT RUN` line, or fails under `MILES_REQUIRE_KERNEL_TESTS=1` (CI).

use burn::tensor::Device;
use miles_bridge::CausalLm;
use miles_core::{NamedTensors, WeightVersion};
use miles_examples::fixture_path;
use miles_examples::grpo_step::{StepOutcome, StepPlan, synchronous_grpo_step};
use miles_ops::kernels::kernel_test_device;

const TEST: &str = "a_grpo_step_on_wgpu_cpu_equals_the_step_on_flex";

async fn step_on(device: &Device, plan: &StepPlan) -> StepOutcome {
    let path = fixture_path("models/glm4moe-tiny").unwrap();
    let model = CausalLm::from_pretrained(path, &device.clone().autodiff()).unwrap();
    synchronous_grpo_step(model, plan).await.unwrap()
}

/// The checks that hold on each device by itself.
fn check_device(name: &str, plan: &StepPlan, o: &StepOutcome) {
    assert_eq!(o.outputs.len(), plan.prompts.len(), "{name}");
    for (i, (prompt, out)) in plan.prompts.iter().zip(&o.outputs).enumerate() {
        assert_eq!(out.weight_version, WeightVersion(0), "{name}: sample {i}");
        assert!(!out.output_ids.is_empty(), "{name}: sample {i}");
        // The engine's rollout log-probs are the trainer's, bit for bit.
        let engine: Vec<f32> = out.output_log_probs.iter().map(|&v| v as f32).collect();
        assert_eq!(engine, o.trainer_log_probs[i], "{name}: sample {i}");
        // One routing row per forwarded position, every layer of the fixture (3), top-2.
        let routed = out
            .routed_experts
            .as_ref()
            .expect("routed experts recorded");
        let rows = prompt.len() + out.output_ids.len() - 1;
        assert_eq!(
            (routed.rows(), routed.layers(), routed.top_k()),
            (rows, 3, 2),
            "{name}: sample {i}"
        );
    }
    let m = &o.metrics;
    assert_eq!(m["train/train_rollout_logprob_abs_diff"], 0.0, "{name}");
    // R3: the trainer compared the recorded routing with its own on the response tokens and
    // found no flipped choice.
    assert!(m["r3/compared_tokens"] > 0.0, "{name}: {m:?}");
    assert_eq!(m["r3/flip_rate"], 0.0, "{name}: {m:?}");
    let grad_norm = m["train/grad_norm"];
    assert!(grad_norm.is_finite() && grad_norm > 0.0, "{name}: {m:?}");
    assert!(m["train/loss"].is_finite(), "{name}: {m:?}");
    // In-place update: the engine serves the actor's new version.
    assert_eq!(o.engine_version, WeightVersion(1), "{name}");
    assert_eq!(o.after_update.weight_version, WeightVersion(1), "{name}");
    // Every trained weight moves; only the routers' score-correction biases (buffers, not
    // trained) stay.
    let unchanged: Vec<&str> = o
        .weights_before
        .iter()
        .filter(|(n, t)| o.weights_after.get(n).is_none_or(|a| a.data() == t.data()))
        .map(|(n, _)| n)
        .collect();
    assert!(
        unchanged
            .iter()
            .all(|n| n.ends_with("mlp.gate.e_score_correction_bias")),
        "{name}: {unchanged:?}"
    );
    assert_eq!(o.weights_before.len(), o.weights_after.len(), "{name}");
}

/// The largest `|a − b|` over every element of every tensor, with the tensor's name.
fn max_weight_diff(a: &NamedTensors, b: &NamedTensors) -> (f32, String) {
    assert_eq!(a.len(), b.len());
    let mut worst = (0.0f32, String::new());
    for (name, t) in a.iter() {
        let x = t.to_f32().unwrap();
        let y = b.get(name).expect("same names").to_f32().unwrap();
        assert_eq!(x.len(), y.len(), "{name}");
        for (p, q) in x.iter().zip(&y) {
            let d = (p - q).abs();
            if d > worst.0 {
                worst = (d, name.to_string());
            }
        }
    }
    worst
}

#[tokio::test]
async fn a_grpo_step_on_wgpu_cpu_equals_the_step_on_flex() {
    let Some(wgpu) = kernel_test_device(TEST) else {
        return;
    };
    // On wgpu the fused log-prob op and the clipped loss are CubeCL kernels.
    assert!(miles_ops::runs_fused(&wgpu.clone().autodiff()));
    let plan = StepPlan::new(512, 4, 6, 8);
    let started = std::time::Instant::now();
    let flex = step_on(&Device::flex(), &plan).await;
    let flex_secs = started.elapsed().as_secs_f64();
    let gpu = step_on(&wgpu, &plan).await;
    eprintln!(
        "{TEST}: step on flex {flex_secs:.1} s, on wgpu-cpu {:.1} s",
        started.elapsed().as_secs_f64() - flex_secs
    );
    check_device("flex", &plan, &flex);
    check_device("wgpu-cpu", &plan, &gpu);

    for (i, (f, g)) in flex.outputs.iter().zip(&gpu.outputs).enumerate() {
        assert_eq!(f.output_ids, g.output_ids, "greedy tokens, sample {i}");
        assert_eq!(
            f.routed_experts, g.routed_experts,
            "routed experts, sample {i}"
        );
        for (a, b) in f.output_log_probs.iter().zip(&g.output_log_probs) {
            assert!((a - b).abs() <= 1e-4, "log-probs, sample {i}: {a} vs {b}");
        }
    }
    assert_eq!(
        flex.after_update.output_ids, gpu.after_update.output_ids,
        "greedy tokens on the updated weights"
    );
    // Every metric of the step but the timings: within 1e-4 relative (1e-6 absolute for
    // values near 0, such as the GRPO loss of a zero-mean group).
    for (key, &a) in &flex.metrics {
        if key.starts_with("perf/") {
            continue;
        }
        let b = gpu.metrics[key];
        assert!(
            (a - b).abs() <= 1e-6 + 1e-4 * a.abs(),
            "{key}: flex {a} vs wgpu {b}"
        );
    }
    assert_eq!(
        flex.metrics
            .keys()
            .filter(|k| !k.starts_with("perf/"))
            .count(),
        gpu.metrics
            .keys()
            .filter(|k| !k.starts_with("perf/"))
            .count()
    );
    let (before, _) = max_weight_diff(&flex.weights_before, &gpu.weights_before);
    assert_eq!(before, 0.0, "both devices start from the fixture's weights");
    // Updated weights. AdamW's first step moves a weight by lr·m/(√v + ε) ≈ ±lr whatever
    // the gradient's size, so where the true gradient is 0 (the key biases: a constant added
    // to every key's score cancels in the softmax) or tiny, rounding noise of either sign
    // becomes a step of up to lr each way. Bound: every element within 2·lr; and all but
    // 0.1 % of the elements outside the key biases within 1e-5 (measured on lavapipe: 3 of
    // 239,344 above 1e-5, the largest 7.5e-5; the key biases up to 1.3e-4).
    let lr = plan.train.lr_schedule.lr as f32;
    let (after, name) = max_weight_diff(&flex.weights_after, &gpu.weights_after);
    eprintln!("{TEST}: largest updated-weight difference {after:e} ({name})");
    assert!(
        after <= 2.0 * lr,
        "updated weights differ by {after} in {name}"
    );
    let (mut loose, mut total) = (0usize, 0usize);
    for (n, t) in flex.weights_after.iter() {
        if n.ends_with("k_proj.bias") {
            continue;
        }
        let x = t.to_f32().unwrap();
        let y = gpu.weights_after.get(n).unwrap().to_f32().unwrap();
        loose += x
            .iter()
            .zip(&y)
            .filter(|(a, b)| (*a - *b).abs() > 1e-5)
            .count();
        total += x.len();
    }
    eprintln!("{TEST}: {loose} of {total} weights (key biases aside) differ by more than 1e-5");
    assert!(
        loose * 1000 <= total,
        "{loose} of {total} weights differ by more than 1e-5"
    );
}
