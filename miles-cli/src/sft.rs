//! Supervised fine-tuning data: chat conversations → training [`Sample`]s with the loss on
//! the assistant's tokens only.
//!
//! The tokens and the loss mask come from miles-tito's session replay
//! ([`TitoTokenizer::replay_conversation`]): every assistant message is tokenized as the model
//! would have generated it (the text its render adds after the generation prompt, up to and
//! including its end-of-turn token, e.g. `…<|im_end|>` for Qwen3), every other token — system,
//! user and tool messages, the chat template's role headers, the boundary newline — comes from
//! the template with mask 0. So the ids the trainer sees are exactly the ids a TITO rollout of
//! the same conversation would hold, and the loss mask is 1 exactly on what the model must
//! learn to produce.
//!
//! A conversation file is JSONL, one object per line: `{"messages": [...], "tools": [...]}`
//! (`tools` optional; messages in OpenAI / Miles form). Messages after the last assistant
//! message are ignored; a line without any assistant message is an error naming it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Device;
use miles_bridge::{CausalLm, score_log_probs};
use miles_core::rng::SplitMix64;
use miles_core::{DType, JsonlMetricsSink, Message, Metrics, PolicyTrainer, Prompt, Role, Sample};
use miles_r3::Fallthrough;
use miles_tito::{HfChat, TitoFamily, TitoTokenizer};
use miles_train::{Actor, BatchLayout, LossType, LrDecayStyle, LrSchedule, TrainConfig};
use serde_json::{Map, Value};

use crate::error::Error;

/// One conversation of an SFT file.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The messages.
    pub messages: Vec<Message>,
    /// Tools offered (OpenAI tool objects), if any.
    pub tools: Option<Vec<Value>>,
}

/// Parses SFT JSONL text (`source` names it in errors). Blank lines are skipped.
pub fn parse_conversations(text: &str, source: &Path) -> Result<Vec<Conversation>, Error> {
    let mut out = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| Error::Line {
            path: source.to_path_buf(),
            line: index + 1,
            reason,
        };
        let Value::Object(mut object) =
            serde_json::from_str::<Value>(line).map_err(|e| bad(e.to_string()))?
        else {
            return Err(bad("not a JSON object".into()));
        };
        let messages = object
            .remove("messages")
            .ok_or_else(|| bad("missing \"messages\"".into()))?;
        let messages: Vec<Message> =
            serde_json::from_value(messages).map_err(|e| bad(format!("invalid messages: {e}")))?;
        if !messages.iter().any(|m| m.role == Role::Assistant) {
            return Err(bad("no assistant message to train on".into()));
        }
        let tools = match object.remove("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(tools)) => Some(tools),
            Some(other) => return Err(bad(format!("\"tools\" must be a list, found {other}"))),
        };
        out.push(Conversation { messages, tools });
    }
    Ok(out)
}

/// Reads an SFT JSONL file.
pub fn read_conversations(path: &Path) -> Result<Vec<Conversation>, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_conversations(&text, path)
}

/// The training sample of a conversation: `tokens` = the replayed ids, the prompt = the
/// ids before the first assistant message, `loss_mask` (over the response) = 1 on
/// assistant-generated ids, 0 elsewhere.
pub fn sft_sample(tito: &TitoTokenizer, conversation: &Conversation) -> Result<Sample, Error> {
    let tools = conversation.tools.as_deref();
    let trajectory = tito.replay_conversation(&conversation.messages, tools)?;
    let Some(first) = trajectory.turns().first() else {
        return Err(Error::Invalid {
            what: "conversation",
            reason: "no assistant message to train on".into(),
        });
    };
    let prompt_len = first.prompt_len;
    let tokens = trajectory.ids().to_vec();
    let loss_mask = trajectory.loss_mask()[prompt_len..].to_vec();
    let first_assistant = conversation
        .messages
        .iter()
        .position(|m| m.role == Role::Assistant)
        .unwrap_or(conversation.messages.len());
    let sample = Sample {
        prompt: Prompt::Messages(conversation.messages[..first_assistant].to_vec()),
        response_length: tokens.len() - prompt_len,
        tokens,
        loss_mask: Some(loss_mask),
        ..Sample::default()
    };
    sample.validate()?;
    Ok(sample)
}

/// Files of an HF model directory that describe the tokenizer and generation (copied next
/// to the fine-tuned weights).
pub const TOKENIZER_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
];

/// What [`run_sft`] does.
#[derive(Debug, Clone)]
pub struct SftOptions {
    /// The HF checkpoint directory (weights, `config.json`, tokenizer and chat template).
    pub hf_checkpoint: PathBuf,
    /// The conversations (JSONL, see the module docs).
    pub data: PathBuf,
    /// The TITO family whose template and boundary rules tokenize the conversations.
    pub family: TitoFamily,
    /// Extra chat-template kwargs.
    pub kwargs: Map<String, Value>,
    /// Passes over the data.
    pub epochs: usize,
    /// Conversations per optimizer step.
    pub global_batch_size: usize,
    /// Peak learning rate (constant schedule).
    pub lr: f64,
    /// Global gradient-norm clip (0: off).
    pub clip_grad: f64,
    /// Shuffle seed (the order of each epoch).
    pub seed: u64,
    /// Where to write the fine-tuned HF directory (weights + the tokenizer files and config).
    pub save: Option<PathBuf>,
    /// Where to write the per-step metrics JSONL.
    pub metrics: Option<PathBuf>,
}

impl SftOptions {
    /// Defaults: family `default`, 3 epochs, batch 8, lr 1e-4, clip 1.0, seed 0.
    pub fn new(hf_checkpoint: impl Into<PathBuf>, data: impl Into<PathBuf>) -> Self {
        Self {
            hf_checkpoint: hf_checkpoint.into(),
            data: data.into(),
            family: TitoFamily::Default,
            kwargs: Map::new(),
            epochs: 3,
            global_batch_size: 8,
            lr: 1e-4,
            clip_grad: 1.0,
            seed: 0,
            save: None,
            metrics: None,
        }
    }
}

/// What [`run_sft`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SftReport {
    /// Conversations trained on.
    pub conversations: usize,
    /// Tokens with loss mask 1 over the data set.
    pub trained_tokens: usize,
    /// Optimizer steps taken.
    pub steps: u64,
    /// Mean negative log-likelihood per trained token over the data set, before training.
    pub nll_before: f64,
    /// The same after training.
    pub nll_after: f64,
    /// `train/loss` of each step.
    pub losses: Vec<f64>,
}

/// Mean negative log-likelihood per masked-in token of `samples` under `model`.
pub fn mean_nll(model: &CausalLm, samples: &[Sample]) -> Result<f64, Error> {
    let mut sum = 0.0f64;
    let mut count = 0usize;
    for s in samples {
        let lp = score_log_probs(
            model,
            &s.tokens,
            s.response_length,
            &Fallthrough,
            &Default::default(),
        )?;
        let mask = s.loss_mask.as_deref().unwrap_or(&[]);
        for (v, m) in lp.iter().zip(mask) {
            if *m == 1 {
                sum -= f64::from(*v);
                count += 1;
            }
        }
    }
    Ok(if count == 0 { 0.0 } else { sum / count as f64 })
}

/// Fine-tunes the checkpoint on the conversations with miles-train's `sft_loss`
/// (`−mean log p` over the loss mask), one optimizer step per `global_batch_size`
/// conversations, seeded shuffling per epoch; `on_step(step, metrics)` is called after each
/// step. Writes the metrics JSONL and the fine-tuned directory when asked.
pub fn run_sft(
    options: &SftOptions,
    mut on_step: impl FnMut(u64, &Metrics),
) -> Result<SftReport, Error> {
    if options.global_batch_size == 0 || options.epochs == 0 {
        return Err(Error::Invalid {
            what: "SFT options",
            reason: "epochs and global batch size must be at least 1".into(),
        });
    }
    let chat = HfChat::load(&options.hf_checkpoint)?;
    let tito = TitoTokenizer::new(&chat, options.family, options.kwargs.clone())?;
    let conversations = read_conversations(&options.data)?;
    let samples = conversations
        .iter()
        .enumerate()
        .map(|(i, c)| {
            sft_sample(&tito, c).map_err(|e| Error::Line {
                path: options.data.clone(),
                line: i + 1,
                reason: e.to_string(),
            })
        })
        .collect::<Result<Vec<Sample>, Error>>()?;
    if samples.is_empty() {
        return Err(Error::Invalid {
            what: "SFT data",
            reason: format!("{} holds no conversation", options.data.display()),
        });
    }
    let device = Device::flex().autodiff();
    let model = CausalLm::from_pretrained(&options.hf_checkpoint, &device)?;
    let vocab = model.config.vocab_size;
    if let Some(bad) = samples
        .iter()
        .flat_map(|s| &s.tokens)
        .find(|&&id| id as usize >= vocab)
    {
        return Err(Error::Invalid {
            what: "SFT data",
            reason: format!(
                "token id {bad} is outside the model's vocabulary of {vocab} (tokenizer and \
                 checkpoint do not match)"
            ),
        });
    }
    let trained_tokens = samples
        .iter()
        .map(|s| {
            s.loss_mask
                .as_deref()
                .map_or(0, |m| m.iter().filter(|v| **v == 1).count())
        })
        .sum();
    let nll_before = mean_nll(&model.valid(), &samples)?;
    let config = TrainConfig {
        loss_type: LossType::SftLoss,
        lr_schedule: LrSchedule {
            lr: options.lr,
            ..LrSchedule::default()
        },
        clip_grad: options.clip_grad,
        ..TrainConfig::default()
    };
    let mut actor = Actor::new(model, config)?;
    if let Some(path) = &options.metrics {
        actor = actor.with_metrics_sink(Arc::new(JsonlMetricsSink::create(path)?));
    }
    let mut rng = SplitMix64::new(options.seed);
    let mut order: Vec<usize> = (0..samples.len()).collect();
    let mut losses = Vec::new();
    let mut step = 0u64;
    for _ in 0..options.epochs {
        for i in (1..order.len()).rev() {
            order.swap(i, rng.range_inclusive(0, i as u64) as usize);
        }
        for chunk in order.chunks(options.global_batch_size) {
            let batch: Vec<Sample> = chunk.iter().map(|&i| samples[i].clone()).collect();
            let metrics = actor.train(step, &batch)?;
            losses.push(metrics.get("train/loss").copied().unwrap_or(f64::NAN));
            on_step(step, &metrics);
            step += 1;
        }
    }
    let nll_after = mean_nll(&actor.model().valid(), &samples)?;
    if let Some(dir) = &options.save {
        actor.model().save_pretrained(dir, DType::F32, None)?;
        for name in TOKENIZER_FILES {
            let from = options.hf_checkpoint.join(name);
            // config.json too: save_pretrained wrote the fields it models; the original keeps
            // the rest (special-token ids, fields of other tools).
            if from.exists() {
                let to = dir.join(name);
                std::fs::copy(&from, &to).map_err(|e| Error::io(&to, e))?;
            }
        }
    }
    Ok(SftReport {
        conversations: samples.len(),
        trained_tokens,
        steps: step,
        nll_before,
        nll_after,
        losses,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3() -> TitoTokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
        let chat = HfChat::load(dir).unwrap();
        TitoTokenizer::new(&chat, TitoFamily::Qwen3, Map::new()).unwrap()
    }

    #[test]
    fn the_mask_covers_exactly_the_assistant_replies() {
        let tito = qwen3();
        let text = r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"2+2="},{"role":"assistant","content":"4"},{"role":"user","content":"3+3="},{"role":"assistant","content":"6"}]}"#;
        let convs = parse_conversations(text, Path::new("t.jsonl")).unwrap();
        let sample = sft_sample(&tito, &convs[0]).unwrap();
        let tok = tito.tokenizer();
        // The ids decode to the qwen3 family's render of the whole conversation (its fixed
        // template with clear_thinking=false gives every assistant turn its think block),
        // minus the final newline the model never generates.
        let text = tok.decode(&sample.tokens, false).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n<|im_start|>user\n3+3=<|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\n6<|im_end|>"
        );
        let mask = sample.loss_mask.as_ref().unwrap();
        let response = &sample.tokens[sample.tokens.len() - sample.response_length..];
        let trained: Vec<u32> = response
            .iter()
            .zip(mask)
            .filter(|(_, m)| **m == 1)
            .map(|(id, _)| *id)
            .collect();
        // Trained: the two replies up to their <|im_end|>, nothing else.
        assert_eq!(
            tok.decode(&trained, false).unwrap(),
            "<think>\n\n</think>\n\n4<|im_end|><think>\n\n</think>\n\n6<|im_end|>"
        );
        // The prompt ends with the first generation prompt.
        let prompt = &sample.tokens[..sample.tokens.len() - sample.response_length];
        assert!(
            tok.decode(prompt, false)
                .unwrap()
                .ends_with("<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n")
        );
        assert_eq!(mask[0], 1);
        assert!(matches!(&sample.prompt, Prompt::Messages(m) if m.len() == 2));
    }

    #[test]
    fn bad_lines_are_named() {
        let p = Path::new("c.jsonl");
        let err = parse_conversations(
            "\n{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}\n",
            p,
        )
        .unwrap_err();
        assert!(matches!(err, Error::Line { line: 2, .. }), "{err}");
        assert!(parse_conversations("{\"msgs\":[]}", p).is_err());
        assert!(parse_conversations("[1]", p).is_err());
        assert!(
            parse_conversations(
                "{\"messages\":[{\"role\":\"assistant\",\"content\":\"x\"}],\"tools\":3}",
                p
            )
            .is_err()
        );
    }
}

/// A supervised warm-start before RL (the examples' first phase, reported as such).
#[derive(Debug, Clone, PartialEq)]
pub struct WarmStart {
    /// Optimizer steps.
    pub steps: usize,
    /// Samples per step (taken in order, wrapping around).
    pub batch_size: usize,
    /// Peak learning rate: cosine-decayed to a tenth of it over the steps (the annealed end
    /// lifts sampled accuracy well above a constant rate's).
    pub lr: f64,
    /// Micro-batch layout.
    pub layout: BatchLayout,
}

/// Trains `model` with `sft_loss` on `samples` (tokens + loss masks, e.g. from
/// [`sft_sample`]) as `options` says; `on_step(step, loss)` after each step. Returns the
/// trained actor (its model and optimizer).
pub fn warm_start(
    model: CausalLm,
    samples: &[Sample],
    options: &WarmStart,
    mut on_step: impl FnMut(usize, f64),
) -> Result<Actor, Error> {
    if samples.is_empty() || options.batch_size == 0 {
        return Err(Error::Invalid {
            what: "warm-start",
            reason: "needs samples and a batch size of at least 1".into(),
        });
    }
    let mut actor = Actor::new(
        model,
        TrainConfig {
            loss_type: LossType::SftLoss,
            lr_schedule: LrSchedule {
                lr: options.lr,
                min_lr: options.lr / 10.0,
                lr_decay_iters: Some(options.steps as u64),
                lr_decay_style: LrDecayStyle::Cosine,
                ..LrSchedule::default()
            },
            micro_batch_size: options.batch_size,
            layout: options.layout,
            ..TrainConfig::default()
        },
    )?;
    let mut cursor = 0;
    for step in 0..options.steps {
        let chunk: Vec<Sample> = (0..options.batch_size)
            .map(|i| samples[(cursor + i) % samples.len()].clone())
            .collect();
        cursor = (cursor + options.batch_size) % samples.len();
        let metrics = actor.train(step as u64, &chunk)?;
        on_step(step, metrics.get("train/loss").copied().unwrap_or(f64::NAN));
    }
    Ok(actor)
}
