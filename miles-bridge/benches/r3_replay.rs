//! Routing replay overhead: MoE forward + backward with the router hook replaying a recorded
//! table (`replay`) versus ordinary top-k routing (`baseline`, miles-r3's `Fallthrough`), on a
//! random GLM-4-MoE model (flex, f32). Also prints the bytes per token of stored routing in
//! miles-r3's compact form versus Miles' int32 `[tokens, all layers, top_k]` arrays.

use std::hint::black_box;
use std::time::Duration;

use burn::tensor::{Device, Int, Tensor};
use criterion::{Criterion, criterion_group, criterion_main};
use miles_bridge::{CausalLm, ModelConfig, ModelInput, ids_tensor, token_logprobs};
use miles_r3::{Fallthrough, MoeModel, ReplayStage, ReplayTable, RouterHook, RoutingReplay};

const BATCH: usize = 4;
const SEQ: usize = 128;

fn config() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{
        "model_type": "glm4_moe", "vocab_size": 2048, "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 3,
        "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5,
        "attention_bias": true, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "initializer_range": 0.05,
        "tie_word_embeddings": false
    }"#,
    )
    .expect("bench config")
}

fn step(model: &CausalLm, ids: &Tensor<2, Int>, hook: &dyn RouterHook) {
    let out = model
        .forward(&ModelInput::new(ids.clone()), hook)
        .expect("forward");
    let loss = token_logprobs(out.logits, ids.clone()).mean().neg();
    black_box(loss.backward());
}

fn bytes_per_token(name: &str, layers: usize, dense: usize, experts: usize, top_k: usize) {
    let model = MoeModel::first_k_dense(layers, dense, experts, top_k).expect("model");
    let table = ReplayTable::padding(1024, model.num_moe_layers(), top_k, experts).expect("table");
    let ours = table.bytes() as f64 / 1024.0;
    let miles = (layers * top_k * 4) as f64;
    println!(
        "r3 routing bytes/token {name}: miles-r3 {ours:.0} (u{} ids, MoE layers only) vs Miles \
         int32 {miles:.0} ({:.2}x smaller)",
        table.id_bytes() * 8,
        miles / ours
    );
}

fn replay_overhead(c: &mut Criterion) {
    let device = Device::flex().autodiff();
    let config = config();
    let model = CausalLm::init(&config, &device).expect("model");
    let moe = config.moe_model().expect("moe").expect("moe layers");
    let mut state = 12345u64;
    let rows: Vec<Vec<u32>> = (0..BATCH)
        .map(|_| {
            (0..SEQ)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    ((state >> 33) % config.vocab_size as u64) as u32
                })
                .collect()
        })
        .collect();
    let ids = ids_tensor(&rows, &device).expect("ids");
    // The table to replay: this model's own routing of the batch, recorded once.
    let recorder = RoutingReplay::new(moe.clone());
    step(&model, &ids, &recorder.with_stage(ReplayStage::Record));
    let replay = RoutingReplay::new(moe.clone());
    replay
        .push(recorder.micro_batch(0).expect("recorded"))
        .expect("push");

    let mut group = c.benchmark_group("r3_replay");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(2));
    group.measurement_time(Duration::from_secs(8));
    group.bench_function("baseline", |b| b.iter(|| step(&model, &ids, &Fallthrough)));
    group.bench_function("replay", |b| {
        b.iter(|| {
            replay.clear_all_forward().expect("clear");
            step(&model, &ids, &replay.with_stage(ReplayStage::ReplayForward));
        })
    });
    group.finish();
    println!(
        "xtask-result: r3_replay ours=@r3_replay/replay baseline=@r3_replay/baseline \
         target=<=1.05 note=MoE fwd+bwd with routing replay vs top-k routing, {BATCH}x{SEQ} tokens"
    );
    println!(
        "r3_replay: GLM-4-MoE {} params, {} MoE layers, {} experts top-{}, batch {BATCH} x {SEQ} \
         tokens, forward + backward (flex f32)",
        model.num_params(),
        moe.num_moe_layers(),
        moe.num_experts(),
        moe.top_k()
    );
    bytes_per_token(
        "bench model (3 layers, 1 dense, 16 experts, top-4)",
        3,
        1,
        16,
        4,
    );
    bytes_per_token(
        "GLM-4.5-355B (92 layers, 3 dense, 160 experts, top-8)",
        92,
        3,
        160,
        8,
    );
    bytes_per_token(
        "GLM-4.7-Flash (47 layers, 1 dense, 64 experts, top-4)",
        47,
        1,
        64,
        4,
    );
    bytes_per_token(
        "Qwen3-235B-A22B (94 layers, 128 experts, top-8)",
        94,
        0,
        128,
        8,
    );
    bytes_per_token(
        "DeepSeek-V3 (61 layers, 3 dense, 256 experts, top-8)",
        61,
        3,
        256,
        8,
    );
}

criterion_group!(benches, replay_overhead);
criterion_main!(benches);
