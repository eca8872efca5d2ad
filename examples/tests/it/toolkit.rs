//! The toy-task toolkit end to end: the generated model directory loads in miles-tito and
//! miles-bridge like any HF directory, passes the TITO verifier, and SFT on addition
//! conversations lowers the loss.

use std::path::PathBuf;

use burn::tensor::Device;
use miles_bridge::{CausalLm, ModelInput, ids_tensor};
use miles_core::Message;
use miles_examples::addition::{AdditionReward, AdditionTask};
use miles_examples::sft::{SftOptions, read_conversations, run_sft, sft_sample};
use miles_examples::template_check::{CheckOptions, check_model_dir};
use miles_examples::toy::{IM_END, ToyModelSpec, write_model_dir};
use miles_r3::Fallthrough;
use miles_tito::{HfChat, TitoFamily, TitoTokenizer};
use serde_json::{Map, json};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("miles-ex-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn toy_model_dir_loads_everywhere_and_is_tito_safe() {
    let dir = temp_dir("toy-dir");
    let device = Device::flex();
    let info = write_model_dir(&dir, &ToyModelSpec::default(), 7, &device).unwrap();
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ] {
        assert!(dir.join(file).exists(), "{file} missing");
    }

    // miles-tito: renders a conversation with Qwen3's template; the ids decode back to the
    // text, and the TITO tokenizer agrees with the plain HF path.
    let chat = HfChat::load(&dir).unwrap();
    let tito = TitoTokenizer::new(&chat, TitoFamily::Qwen3, Map::new()).unwrap();
    let messages = vec![Message::user("12+35="), Message::assistant("47")];
    let values: Vec<_> = messages.iter().map(Message::to_template_value).collect();
    let rendered = chat
        .apply_chat_template(miles_tito::RenderArgs {
            messages: &values,
            tools: None,
            add_generation_prompt: false,
            kwargs: &Map::new(),
        })
        .unwrap();
    assert_eq!(
        rendered.text,
        "<|im_start|>user\n12+35=<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n47<|im_end|>\n"
    );
    let rendered_ids = rendered
        .ids
        .clone()
        .expect("the toy directory has a tokenizer");
    assert_eq!(tito.decode(&rendered_ids).unwrap(), rendered.text);
    assert_eq!(tito.encode(&rendered.text).unwrap(), rendered_ids);
    assert!(
        rendered_ids
            .iter()
            .all(|&id| (id as usize) < info.vocab_size)
    );
    let trajectory = tito.replay_conversation(&messages, None).unwrap();
    let trained: Vec<u32> = trajectory
        .ids()
        .iter()
        .zip(trajectory.loss_mask())
        .filter(|(_, m)| **m == 1)
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(
        tito.decode(&trained).unwrap(),
        format!("<think>\n\n</think>\n\n47{IM_END}")
    );

    // miles-bridge: the checkpoint builds, with the tokenizer's vocabulary, and runs.
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    assert_eq!(model.config.vocab_size, info.vocab_size);
    assert_eq!(model.num_params(), info.num_params);
    assert_eq!(model.config.first_k_dense_replace, 1);
    assert_eq!(model.config.n_routed_experts, 8);
    let n = rendered_ids.len();
    let input = ids_tensor(&[rendered_ids], &device).unwrap();
    let out = model
        .forward(&ModelInput::new(input), &Fallthrough)
        .unwrap();
    assert_eq!(out.logits.dims(), [1, n, info.vocab_size]);
    assert_eq!(out.routing.len(), 1); // two layers, the first dense

    // The verifier: TITO-safe with the guessed qwen3 family.
    let check = check_model_dir(&CheckOptions::new(&dir)).unwrap();
    assert_eq!(check.family, TitoFamily::Qwen3);
    assert!(check.tito_safe(), "{}", check.render());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sft_on_addition_conversations_lowers_the_loss() {
    let dir = temp_dir("toy-sft");
    let model_dir = dir.join("model");
    let info = write_model_dir(&model_dir, &ToyModelSpec::default(), 3, &Device::flex()).unwrap();
    let split = AdditionTask {
        min_digits: 1,
        max_digits: 2,
        seed: 11,
    }
    .split(16, 4)
    .unwrap();
    let data = dir.join("sft.jsonl");
    let lines: Vec<String> = split
        .train
        .iter()
        .map(|p| {
            json!({"messages": [
                {"role": "user", "content": p.question()},
                {"role": "assistant", "content": p.answer()},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();

    // The samples: the loss mask covers the reply "…<answer><|im_end|>" only.
    let chat = HfChat::load(&model_dir).unwrap();
    let tito = TitoTokenizer::new(&chat, TitoFamily::Qwen3, Map::new()).unwrap();
    let conversations = read_conversations(&data).unwrap();
    let sample = sft_sample(&tito, &conversations[0]).unwrap();
    let mask = sample.loss_mask.clone().unwrap();
    let response = &sample.tokens[sample.tokens.len() - sample.response_length..];
    assert!(
        mask.iter().all(|&m| m == 1),
        "single-turn: the response is all reply"
    );
    assert!(
        tito.decode(response)
            .unwrap()
            .ends_with(&format!("{}{IM_END}", split.train[0].answer()))
    );
    assert!(
        AdditionReward::default().score(&tito.decode(response).unwrap(), &split.train[0].answer())
            == 1.0
    );

    let mut options = SftOptions::new(&model_dir, &data);
    options.family = TitoFamily::Qwen3;
    options.epochs = 4;
    options.global_batch_size = 8;
    options.lr = 3e-3;
    options.save = Some(dir.join("out"));
    options.metrics = Some(dir.join("metrics.jsonl"));
    let mut seen = Vec::new();
    let report = run_sft(&options, |step, m| seen.push((step, m["train/loss"]))).unwrap();
    assert_eq!(report.steps, 8); // 16 conversations / 8 per step × 4 epochs
    assert_eq!(seen.len(), 8);
    assert_eq!(report.conversations, 16);
    assert!(
        report.nll_after < report.nll_before - 0.5,
        "NLL {} -> {}",
        report.nll_before,
        report.nll_after
    );
    // A random model starts near ln(vocab) per token.
    let uniform = (info.vocab_size as f64).ln();
    assert!((report.nll_before - uniform).abs() < 0.5, "{report:?}");
    // The metrics file has one line per step, and the saved directory reloads.
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 8);
    let reloaded = CausalLm::from_pretrained(dir.join("out"), &Device::flex()).unwrap();
    assert_eq!(reloaded.config.vocab_size, info.vocab_size);
    assert!(HfChat::load(dir.join("out")).unwrap().tokenizer().is_some());
    std::fs::remove_dir_all(dir).unwrap();
}
