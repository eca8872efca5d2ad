//! Rollout routing replay (miles-r3) on real MoE models: the `glm4moe-tiny` and `dsv3-tiny`
//! (sigmoid router, bias, groups, scaling) and `qwen3moe-tiny` (softmax router) fixtures.
//!
//! The "rollout engine" is the fixture model run on each sample alone; its routing travels the
//! way SGLang's does (`RoutedExperts` `[tokens − 1, all layers, top_k]`, base64 int32 on the
//! wire) into `Sample::rollout_routed_experts`. The trainer packs the samples into a batch,
//! maps their routing with `RoutingReplay::push_samples` and runs its forward with the replay
//! as router hook. The trainer's weights are perturbed slightly (as FP8 / kernel differences
//! would) so that tokens flip experts.

use std::path::PathBuf;

use burn::tensor::{Device, Int, Tensor, TensorData};
use miles_bridge::{CausalLm, ModelInput, ModelOutput, ids_tensor, token_logprobs};
use miles_core::{DType, Prompt, RoutedExperts, Sample, TensorBytes};
use miles_r3::{
    BatchLayout, Fallthrough, FlipStats, MoeModel, ReplayStage, ReplayTable, RouterHook,
    RoutingReplay, replay_table_for_batch,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
}

/// Deterministic uniform numbers in [0, 1) (64-bit LCG, top 53 bits).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

const LENGTHS: [usize; 4] = [40, 33, 47, 26];

fn token_lists(vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = Lcg(7);
    LENGTHS
        .iter()
        .map(|&n| (0..n).map(|_| (rng.next() * vocab as f64) as u32).collect())
        .collect()
}

fn moe_model(model: &CausalLm) -> MoeModel {
    model.config.moe_model().unwrap().unwrap()
}

/// The rollout engine: each sample forwarded alone; routing and log-probs stored in the
/// sample as an engine reports them (routing through the SGLang base64 codec).
fn rollout(engine: &CausalLm, device: &Device) -> Vec<Sample> {
    let moe = moe_model(engine);
    token_lists(engine.config.vocab_size)
        .into_iter()
        .map(|tokens| {
            let n = tokens.len();
            let ids = ids_tensor(std::slice::from_ref(&tokens), device).unwrap();
            let out = engine
                .forward(&ModelInput::new(ids.clone()), &Fallthrough)
                .unwrap();
            let lp: Vec<f64> = host_f32(token_logprobs(out.logits.clone(), ids))
                .into_iter()
                .map(f64::from)
                .collect();
            let layers: Vec<Vec<i32>> = out.routing.iter().map(|r| host_ids(&r.experts)).collect();
            let slices: Vec<&[i32]> = layers.iter().map(Vec::as_slice).collect();
            let table =
                ReplayTable::from_layer_ids(n, moe.top_k(), moe.num_experts(), &slices).unwrap();
            let routed = table.to_routed_experts(&moe, 0..n - 1).unwrap();
            // On the wire: meta_info.routed_experts, base64 of int32.
            let wire =
                RoutedExperts::from_base64(&routed.to_base64(), n - 1, moe.num_layers()).unwrap();
            assert_eq!(wire, routed);
            Sample::builder(Prompt::Text(String::new()))
                .tokens(tokens, n - 1)
                .rollout_log_probs(lp[..].to_vec())
                .routed_experts(wire)
                .build()
                .unwrap()
        })
        .collect()
}

fn host_f32(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

fn host_ids(t: &Tensor<2, Int>) -> Vec<i32> {
    t.clone()
        .into_data()
        .convert::<i32>()
        .try_into_vec::<i32>()
        .unwrap()
}

/// Samples 0+1 and 2+3 packed into two rows of 80 positions.
fn layout() -> BatchLayout {
    BatchLayout::packed(vec![vec![0, 1], vec![2, 3]], 80)
}

fn batch_input(samples: &[Sample], layout: &BatchLayout, device: &Device) -> ModelInput {
    let t = layout.tokens(samples, 0).unwrap();
    let ints = |v: Vec<i32>| Tensor::<2, Int>::from_data(TensorData::new(v, t.shape), device);
    let mut input = ModelInput::new(ints(t.input_ids.iter().map(|&i| i as i32).collect()));
    input.position_ids = Some(ints(t.position_ids.iter().map(|&p| p as i32).collect()));
    input.segment_ids = Some(ints(t.segment_ids.iter().map(|&s| s as i32).collect()));
    input
}

/// Per-sample trainer log-probs (`tokens − 1` each) out of a batch forward, and the output.
struct TrainerPass {
    logprobs: Vec<Vec<f32>>,
    selected: Tensor<1>,
    output: ModelOutput,
}

fn trainer_pass(
    model: &CausalLm,
    samples: &[Sample],
    layout: &BatchLayout,
    hook: &dyn RouterHook,
    device: &Device,
) -> TrainerPass {
    let input = batch_input(samples, layout, device);
    let output = model.forward(&input, hook).unwrap();
    let lp = token_logprobs(output.logits.clone(), input.input_ids.clone());
    let seq = layout.seq_len();
    let flat = lp.reshape([layout.rows().len() * (seq - 1)]);
    let lengths: Vec<usize> = samples.iter().map(|s| s.tokens.len()).collect();
    let offsets = layout.offsets(&lengths).unwrap();
    let mut index = Vec::new();
    let mut logprobs = Vec::new();
    let values = flat
        .clone()
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap();
    for (s, n) in lengths.iter().enumerate() {
        let o = offsets[s].unwrap();
        let start = (o / seq) * (seq - 1) + o % seq;
        index.extend((start..start + n - 1).map(|i| i as i32));
        logprobs.push(values[start..start + n - 1].to_vec());
    }
    let count = index.len();
    let selected = flat.select(
        0,
        Tensor::<1, Int>::from_data(TensorData::new(index, [count]), device),
    );
    TrainerPass {
        logprobs,
        selected,
        output,
    }
}

fn max_diff_to_rollout(samples: &[Sample], logprobs: &[Vec<f32>]) -> f64 {
    samples
        .iter()
        .zip(logprobs)
        .flat_map(|(s, lp)| {
            let r = s.rollout_log_probs.as_ref().unwrap();
            assert_eq!(r.len(), lp.len());
            r.iter()
                .zip(lp)
                .map(|(a, b)| (a - *b as f64).abs())
                .collect::<Vec<_>>()
        })
        .fold(0.0, f64::max)
}

/// The trainer's weights: `f(name, value, rng)` applied to every HF tensor.
fn perturbed(
    model: &CausalLm,
    device: &Device,
    f: impl Fn(&str, f32, &mut Lcg) -> f32,
) -> CausalLm {
    let mut rng = Lcg(42);
    let mut tensors = model.to_hf_tensors(DType::F32).unwrap();
    for (name, tensor) in tensors.iter_mut() {
        let values: Vec<f32> = tensor
            .to_f32()
            .unwrap()
            .into_iter()
            .map(|v| f(name, v, &mut rng))
            .collect();
        *tensor = TensorBytes::from_f32(tensor.shape().to_vec(), &values).unwrap();
    }
    CausalLm::from_hf_tensors(&model.config, tensors, device).unwrap()
}

/// Relative noise `eps` on every weight.
fn all_weights(eps: f64) -> impl Fn(&str, f32, &mut Lcg) -> f32 {
    move |_, v, rng| (v as f64 * (1.0 + eps * (2.0 * rng.next() - 1.0))) as f32
}

/// Absolute noise on GLM's `e_score_correction_bias` only: changes which experts are
/// selected, never the gate weights or the experts themselves.
fn selection_bias(eps: f64) -> impl Fn(&str, f32, &mut Lcg) -> f32 {
    move |name, v, rng| {
        if name.ends_with("e_score_correction_bias") {
            (v as f64 + eps * (2.0 * rng.next() - 1.0)) as f32
        } else {
            v
        }
    }
}

/// Flip rate of the trainer's own routing against the rollout's: a `record` pass.
fn flips_without_replay(
    model: &CausalLm,
    samples: &[Sample],
    device: &Device,
) -> (FlipStats, TrainerPass, ReplayTable) {
    let moe = moe_model(model);
    let replay = RoutingReplay::new(moe.clone());
    let pass = trainer_pass(
        model,
        samples,
        &layout(),
        &replay.with_stage(ReplayStage::Record),
        device,
    );
    let rollout_table = replay_table_for_batch(samples, &layout(), &moe).unwrap();
    let recorded = replay.micro_batch(0).unwrap();
    let stats = FlipStats::compare(&moe, &rollout_table, &recorded).unwrap();
    (stats, pass, recorded)
}

fn replayed(model: &CausalLm, samples: &[Sample], device: &Device) -> (TrainerPass, FlipStats) {
    let replay = RoutingReplay::new(moe_model(model));
    replay.push_samples(samples, &layout()).unwrap();
    replay.set_compare(true).unwrap();
    let pass = trainer_pass(
        model,
        samples,
        &layout(),
        &replay.with_stage(ReplayStage::ReplayForward),
        device,
    );
    // The experts actually used are the rollout's, token by token.
    let used = layer_tables(&pass.output, model);
    let want = replay_table_for_batch(samples, &layout(), &moe_model(model)).unwrap();
    for m in 0..used.moe_layers() {
        for row in 0..used.rows() {
            if !want.is_padding_row(row, m) {
                assert_eq!(used.get(row, m), want.get(row, m), "row {row} layer {m}");
            }
        }
    }
    (pass, replay.take_flip_stats().unwrap())
}

fn layer_tables(out: &ModelOutput, model: &CausalLm) -> ReplayTable {
    let moe = moe_model(model);
    let layers: Vec<Vec<i32>> = out.routing.iter().map(|r| host_ids(&r.experts)).collect();
    let rows = layers[0].len() / moe.top_k();
    let slices: Vec<&[i32]> = layers.iter().map(Vec::as_slice).collect();
    ReplayTable::from_layer_ids(rows, moe.top_k(), moe.num_experts(), &slices).unwrap()
}

fn bits(v: &[Vec<f32>]) -> Vec<u32> {
    v.iter().flatten().map(|x| x.to_bits()).collect()
}

fn router_grad(model: &CausalLm, pass: &TrainerPass, layer: usize) -> Vec<u32> {
    let grads = pass.selected.clone().mean().neg().backward();
    let mut out = None;
    // GLM / DeepSeek / Qwen name the router `mlp.gate`, GPT-OSS `mlp.router`.
    let names = [
        format!("model.layers.{layer}.mlp.gate.weight"),
        format!("model.layers.{layer}.mlp.router.weight"),
    ];
    model.visit_params(&mut |n, p| {
        if names.iter().any(|name| name == n) {
            out = p.grad(&grads);
        }
    });
    let g = out.expect("router gradient").convert::<f32>();
    let values = g.try_into_vec::<f32>().unwrap();
    assert!(values.iter().any(|v| *v != 0.0), "router gradient is zero");
    values.into_iter().map(f32::to_bits).collect()
}

fn format_rates(stats: &FlipStats) -> String {
    stats
        .layers()
        .iter()
        .map(|(l, c)| format!("layer {l}: {}/{}", c.flipped, c.tokens))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The whole proof on one fixture; returns nothing, prints the figures, asserts the claims.
fn prove(fixture_name: &str, selection_only: bool) {
    let device = Device::flex().autodiff();
    let engine = CausalLm::from_pretrained(fixture(fixture_name), &device).unwrap();
    let samples = rollout(&engine, &device);
    let moe = moe_model(&engine);

    // 1. Identical weights: the recorded routing replays the log-probs bit for bit, and the
    //    router gradient is the same bit for bit (replay keeps the router differentiable).
    let (same_flips, recorded_pass, recorded_table) =
        flips_without_replay(&engine, &samples, &device);
    let replay = RoutingReplay::new(moe.clone());
    replay.push(recorded_table).unwrap();
    let replay_pass = trainer_pass(
        &engine,
        &samples,
        &layout(),
        &replay.with_stage(ReplayStage::ReplayForward),
        &device,
    );
    assert_eq!(
        bits(&recorded_pass.logprobs),
        bits(&replay_pass.logprobs),
        "{fixture_name}: replay of recorded routing is not bit-identical"
    );
    let first_moe = moe.moe_layers()[0];
    assert_eq!(
        router_grad(&engine, &recorded_pass, first_moe),
        router_grad(&engine, &replay_pass, first_moe),
        "{fixture_name}: router gradient under replay differs"
    );
    let (same_replay, _) = replayed(&engine, &samples, &device);
    let d_same = max_diff_to_rollout(&samples, &recorded_pass.logprobs);
    let d_same_replay = max_diff_to_rollout(&samples, &same_replay.logprobs);
    println!(
        "{fixture_name}: identical weights: flip rate {:.4} ({}), max |lp - rollout| \
         {d_same:.3e} without replay, {d_same_replay:.3e} with replay; replay of recorded \
         routing bit-identical (log-probs and router gradient)",
        same_flips.overall_flip_rate().unwrap(),
        format_rates(&same_flips)
    );

    // 2. Perturbed trainer weights.
    let mut cases: Vec<(&str, CausalLm)> = vec![(
        "all weights ×(1 ± 1e-2)",
        perturbed(&engine, &device, all_weights(1e-2)),
    )];
    if selection_only {
        cases.push((
            "e_score_correction_bias ± 2e-2",
            perturbed(&engine, &device, selection_bias(2e-2)),
        ));
    }
    for (label, trainer) in cases {
        let (flips, plain, _) = flips_without_replay(&trainer, &samples, &device);
        let (with_replay, replay_flips) = replayed(&trainer, &samples, &device);
        let d_plain = max_diff_to_rollout(&samples, &plain.logprobs);
        let d_replay = max_diff_to_rollout(&samples, &with_replay.logprobs);
        let rate = flips.overall_flip_rate().unwrap();
        println!(
            "{fixture_name}: {label}: flip rate without replay {rate:.4} ({}); max |lp - \
             rollout| {d_plain:.3e} without replay, {d_replay:.3e} with replay; trainer's own \
             choice under replay differs on {:.4}",
            format_rates(&flips),
            replay_flips.overall_flip_rate().unwrap()
        );
        let metrics = flips.to_metrics();
        for layer in moe.moe_layers() {
            assert!(metrics.contains_key(&format!("r3/flip_rate/layer_{layer}")));
        }
        assert!(rate > 0.0, "{label}: no token flipped");
        assert!(
            d_replay < d_plain,
            "{label}: replay ({d_replay}) does not bring the trainer closer than {d_plain}"
        );
        // The router still learns under replay.
        router_grad(&trainer, &with_replay, first_moe);
        if label.starts_with("e_score") {
            // Selection-only noise: with replay the trainer computes exactly what it computes
            // with the original weights and the rollout routing.
            assert_eq!(
                bits(&with_replay.logprobs),
                bits(&same_replay.logprobs),
                "bias-only perturbation leaks into replayed log-probs"
            );
        }
    }
}

#[test]
fn glm4_moe_replay_removes_routing_flips() {
    prove("glm4moe-tiny", true);
}

/// DeepSeek-V3 (`dsv3-tiny`: MLA, sigmoid routing with `e_score_correction_bias`, groups of
/// two experts, top-2 of 2 groups, shared expert): the same router hook records and replays.
#[test]
fn deepseek_v3_replay_removes_routing_flips() {
    prove("dsv3-tiny", true);
}

/// GLM-4.7-Flash (`glm47flash-tiny`: latent attention, sigmoid routing in one group, MoE
/// layers 1 and 3 chosen by `mlp_layer_types`).
#[test]
fn glm4_moe_lite_replay_removes_routing_flips() {
    prove("glm47flash-tiny", true);
}

/// Qwen3.5-MoE (`qwen35moe-tiny`: softmax routing, a gated shared expert, Gated DeltaNet
/// layers that restart at every packed segment).
#[test]
fn qwen3_5_moe_replay_removes_routing_flips() {
    prove("qwen35moe-tiny", false);
}

/// GPT-OSS (`gptoss-tiny`: biased router, top-k of the logits then softmax over the chosen,
/// biased experts; every layer MoE).
#[test]
fn gpt_oss_replay_removes_routing_flips() {
    prove("gptoss-tiny", false);
}

#[test]
fn qwen3_moe_replay_removes_routing_flips() {
    prove("qwen3moe-tiny", false);
}

#[test]
fn padded_layout_replays_like_packed() {
    let device = Device::flex();
    let engine = CausalLm::from_pretrained(fixture("glm4moe-tiny"), &device).unwrap();
    let samples = rollout(&engine, &device);
    let moe = moe_model(&engine);
    let padded = BatchLayout::padded(samples.len(), 48);
    let replay = RoutingReplay::new(moe);
    replay.push_samples(&samples, &padded).unwrap();
    replay.push_samples(&samples, &layout()).unwrap();
    replay.set_stage(ReplayStage::ReplayForward).unwrap();
    let a = trainer_pass(&engine, &samples, &padded, &replay, &device);
    let b = trainer_pass(&engine, &samples, &layout(), &replay, &device);
    let diff = a
        .logprobs
        .iter()
        .flatten()
        .zip(b.logprobs.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(diff <= 1e-5, "padded vs packed replay differ by {diff}");
    // Both micro-batches consumed; a third forward has nothing left.
    let input = batch_input(&samples, &padded, &device);
    assert!(engine.forward(&input, &replay).is_err());
}
