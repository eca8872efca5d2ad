//! # agentic_tool_call — a multi-turn tool-using agent trained with GRPO
//!
//! The agent is an ordinary async function ([`CalculatorAgent`]): it sends OpenAI-style chat
//! completions over HTTP to a session server on loopback, runs the calculator calls the model
//! makes, and sends the results back as `tool` messages until the model answers. The session
//! server (miles-session) serves the embedded engine (miles-rollout) and records every turn
//! token in, token out: the exact ids the model produced, their log-probs and routed experts,
//! with the tool outputs and the chat template's boundaries masked out of the loss. Each
//! finished session becomes one training sample, and GRPO (TIS + R3) trains on them; weight
//! updates go to the engine the session server serves.
//!
//! The task: `23*47=` with two-digit operands. A tiny GLM-4-MoE cannot multiply; it must
//! call `calculator` with `{"expression": "23*47"}` and repeat the tool's answer. A short
//! supervised warm-start on demonstrations (reported as such) teaches the tool-call format.
//! The demonstrator is careless (`--demo-slip-rate 0.3`): 30 % of its demonstrations answer
//! at once from a mental estimate instead of calling the calculator, and the warm-start
//! imitates that too. GRPO then trains through the agent, with a reward that checks the
//! product. The run prints the held-out reward before anything,
//! after the warm-start and after GRPO, and the TITO mismatch rate: the share of sessions
//! whose accumulated token ids differ from a fresh render of their messages (must be 0).
//!
//! ```text
//! cargo run --release --example agentic_tool_call            # defaults, a few minutes
//! cargo run --release --example agentic_tool_call -- --help  # every flag
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::Module;
use miles_bridge::CausalLm;
use miles_core::rng::SplitMix64;
use miles_core::{
    DType, JsonlMetricsSink, MetricsSink, PolicyTrainer, SamplingParams, WeightVersion,
};
use miles_examples::args::{Args, Cli, exit_code, parse_env};
use miles_examples::calculator::{
    CalculatorAgent, CalculatorReward, MulProblem, MulTask, TOOL_CALL_WORDS,
};
use miles_examples::sft::{WarmStart, sft_sample, warm_start};
use miles_examples::toy::{ToyModelSpec, write_model_dir};
use miles_examples::wiring::{
    ProgressSink, embedded_engine, held_out_reward, save_hf_checkpoint, write_final_outputs,
};
use miles_ops::{AdvantageConfig, AdvantageEstimator};
use miles_rollout::{
    AgentGenerator, ChatPromptEncoder, DataSource, EvalSet, LoopConfig, RlLoop, RolloutConfig,
    RolloutManager, SharedTrainer,
};
use miles_session::agent::AgentDriverConfig;
use miles_tito::{HfChat, TitoFamily, TitoTokenizer};
use miles_train::{Actor, BatchLayout, TrainConfig};
use serde_json::json;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ABOUT: &str = "A multi-turn calculator agent, written as an async function over an \
OpenAI-style HTTP client, trained with GRPO through the session server (token in, token out) \
on the embedded engine. Prints the reward before / after and the TITO mismatch rate.";

fn cli() -> Cli {
    Cli::new("agentic_tool_call", ABOUT)
        .option(
            "--output-dir",
            "DIR",
            Some("runs/agentic_tool_call"),
            "where the run writes everything",
        )
        .flag(
            "--sync",
            "synchronous loop (rollout → train → update) instead of fully asynchronous",
        )
        .option("--num-rollout", "N", Some("60"), "GRPO steps")
        .option("--rollout-batch-size", "N", Some("16"), "prompts per step")
        .option(
            "--n-samples-per-prompt",
            "N",
            Some("8"),
            "agent runs per prompt (the GRPO group)",
        )
        .option("--max-turns", "N", Some("3"), "model turns per agent run")
        .flag("--declare-tools", "send the calculator in each request's `tools` (Qwen3's template then puts a ~500-token tool preamble in every prompt: 20 warm-start steps took 152 s instead of 7 s on 2 cores); by default the model learns the tool from the warm-start")
        .option(
            "--rollout-max-response-len",
            "N",
            Some("40"),
            "token limit of one model turn",
        )
        .option(
            "--rollout-temperature",
            "T",
            Some("1.0"),
            "sampling temperature (also of the held-out evaluation)",
        )
        .option("--eps-clip", "X", Some("0.2"), "PPO clip (low side)")
        .option("--eps-clip-high", "X", Some("0.28"), "PPO clip (high side)")
        .option(
            "--use-tis",
            "BOOL",
            Some("true"),
            "truncated importance sampling on the rollout / trainer mismatch",
        )
        .option(
            "--use-rollout-routing-replay",
            "BOOL",
            Some("true"),
            "record routed experts in the sessions and replay them in training (R3)",
        )
        .option("--lr", "LR", Some("1e-4"), "GRPO learning rate (AdamW)")
        .option(
            "--max-weight-staleness",
            "N",
            Some("1"),
            "samples older than this many weight versions are regenerated",
        )
        .option(
            "--eval-interval",
            "N",
            Some("10"),
            "evaluate the held-out prompts every N steps",
        )
        .option(
            "--n-samples-per-eval-prompt",
            "N",
            Some("2"),
            "agent runs per held-out prompt",
        )
        .option(
            "--sft-steps",
            "N",
            Some("600"),
            "supervised warm-start steps on demonstrations (0 = none)",
        )
        .option(
            "--demo-slip-rate",
            "P",
            Some("0.3"),
            "the demonstrator is careless: each demonstration is, with probability P, an answer \
             given at once from a mental estimate (23*47 → 1000, operands rounded to tens) \
             instead of a calculator call; fixed per problem, seeded",
        )
        .option(
            "--sft-batch-size",
            "N",
            Some("32"),
            "demonstrations per warm-start step",
        )
        .option(
            "--sft-lr",
            "LR",
            Some("3e-3"),
            "warm-start peak learning rate (cosine to a tenth)",
        )
        .option(
            "--batch-layout",
            "NAME",
            Some("padded"),
            "training micro-batch layout: padded | packed | per_sample | shared_prefix",
        )
        .option(
            "--num-train-prompts",
            "N",
            Some("2000"),
            "training problems",
        )
        .option("--num-eval-prompts", "N", Some("64"), "held-out problems")
        .option(
            "--hidden-size",
            "N",
            Some("96"),
            "width of the built GLM-4-MoE",
        )
        .option(
            "--num-layers",
            "N",
            Some("3"),
            "layers of the built GLM-4-MoE (the first dense)",
        )
        .option(
            "--seed",
            "N",
            Some("1234"),
            "seed of data, model and sampling",
        )
        .option(
            "--device",
            "DEV",
            Some("flex"),
            "device of the model, trainer and embedded engine: flex | wgpu[:N] | wgpu-cpu | \
             cuda[:N] (wgpu / cuda need the `wgpu` / `cuda` feature)",
        )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    match parse_env(&cli()) {
        Ok(args) => exit_code(run(args).await),
        Err(code) => code,
    }
}

async fn run(args: Args) -> Result<(), BoxError> {
    let started = Instant::now();
    let out = PathBuf::from(args.required("--output-dir")?);
    let model_dir = out.join("model");
    let seed: u64 = args.parsed("--seed")?;
    let n: usize = args.parsed("--n-samples-per-prompt")?;
    let num_rollout: u64 = args.parsed("--num-rollout")?;
    let use_r3 = args.boolean("--use-rollout-routing-replay")?;
    let layout: BatchLayout = args.parsed("--batch-layout")?;
    let device = miles_ops::device::parse_device(args.required("--device")?)?;

    // 1. The model directory: byte-level tokenizer (with merges for the tool-call JSON),
    //    Qwen3's chat template, a small GLM-4-MoE.
    std::fs::create_dir_all(&out)?;
    let hidden: usize = args.parsed("--hidden-size")?;
    let spec = ToyModelSpec {
        hidden_size: hidden,
        num_hidden_layers: args.parsed("--num-layers")?,
        intermediate_size: 2 * hidden,
        extra_merged_words: TOOL_CALL_WORDS.iter().map(|w| w.to_string()).collect(),
        ..ToyModelSpec::default()
    };
    let info = write_model_dir(&model_dir, &spec, seed, &device)?;
    println!(
        "built {}: GLM-4-MoE, {} parameters, vocabulary {}",
        model_dir.display(),
        info.num_params,
        info.vocab_size
    );
    // The end of an assistant turn is `<|im_end|>` (Qwen3's template closes every message
    // with it); `<|endoftext|>` is not a stop here, so every finished turn is a closed
    // message.
    let eos_ids = vec![info.eos_token_id];
    let model = CausalLm::from_pretrained(&model_dir, &device.clone().autodiff())?;

    // 2. The engine and the session server over it (Qwen3's TITO family), on loopback.
    let tokenizer = tokenizers::Tokenizer::from_file(model_dir.join("tokenizer.json"))
        .map_err(|e| format!("tokenizer: {e}"))?;
    let control: Vec<u32> = ["<|im_start|>", "<|endoftext|>"]
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    let engine = embedded_engine(
        model.valid(),
        &model_dir,
        eos_ids.clone(),
        128,
        seed,
        miles_bridge::Precision::F32,
    )?;
    let server_url = miles_examples::wiring::spawn_session_server(
        engine.clone(),
        &model_dir,
        "qwen3",
        miles_session::server::SessionServerConfig {
            return_routed_experts: use_r3,
            ..Default::default()
        },
    )
    .await?;
    println!("session server on {server_url}");

    // 3. Data, reward, the agent as the rollout's sample generator.
    let split = MulTask { seed }.split(
        args.parsed("--num-train-prompts")?,
        args.parsed("--num-eval-prompts")?,
    )?;
    let reward = Arc::new(CalculatorReward::default().with_control_tokens(control));
    let declare_tools = args.flag("--declare-tools");
    let agent = Arc::new(CalculatorAgent {
        max_turns: args.parsed("--max-turns")?,
        declare_tools,
        ..CalculatorAgent::default()
    });
    let generator = Arc::new(AgentGenerator::new(
        agent,
        AgentDriverConfig::new(server_url.clone()),
    ));
    let encoder = Arc::new(ChatPromptEncoder::load(&model_dir)?);
    let sampling = SamplingParams {
        temperature: args.parsed("--rollout-temperature")?,
        stop_token_ids: eos_ids.clone(),
        ..SamplingParams::default()
    };
    let rollout_config = RolloutConfig {
        n_samples_per_prompt: n,
        rollout_batch_size: args.parsed("--rollout-batch-size")?,
        max_concurrency: 128,
        sampling,
        rollout_max_response_len: args.parsed("--rollout-max-response-len")?,
        rollout_seed: Some(seed),
        return_routed_experts: use_r3,
        ..RolloutConfig::default()
    };
    let manager = Arc::new(
        RolloutManager::new(
            rollout_config.clone(),
            engine.clone(),
            encoder.clone(),
            reward.clone(),
        )?
        .with_generator(generator.clone()),
    );
    let eval_manager = Arc::new(
        RolloutManager::new(
            RolloutConfig {
                n_samples_per_prompt: args.parsed("--n-samples-per-eval-prompt")?,
                rollout_batch_size: split.held_out.len(),
                rollout_seed: Some(seed ^ 0xE7A1),
                ..rollout_config
            },
            engine.clone(),
            encoder,
            reward.clone(),
        )?
        .with_generator(generator),
    );
    let eval_set = || EvalSet {
        name: "calculator".into(),
        prompts: split
            .held_out
            .iter()
            .map(MulProblem::prompt_record)
            .collect(),
        manager: eval_manager.clone(),
    };
    let eval_now = |label: &'static str| held_out_reward(eval_set(), label);

    // 4. Before anything; the supervised warm-start on demonstrations; after it.
    let mut summary = json!({});
    summary["reward_initial"] = json!(eval_now("before any training").await?);
    let mut model = model;
    let steps: usize = args.parsed("--sft-steps")?;
    if steps > 0 {
        let t = Instant::now();
        let tito = TitoTokenizer::new(
            &HfChat::load(&model_dir)?,
            TitoFamily::Qwen3,
            Default::default(),
        )?;
        let slip_rate: f64 = args.parsed("--demo-slip-rate")?;
        if !(0.0..=1.0).contains(&slip_rate) {
            return Err(
                format!("--demo-slip-rate {slip_rate}: expected a probability in [0, 1]").into(),
            );
        }
        let mut rng = SplitMix64::new(seed ^ 0xD3E0_5119);
        let mut slips = 0usize;
        let samples = split
            .train
            .iter()
            .map(|p| {
                let unit = rng.next_f64();
                let demo = if unit < slip_rate {
                    slips += 1;
                    p.careless_demonstration(declare_tools)?
                } else {
                    p.demonstration(declare_tools)?
                };
                Ok(sft_sample(&tito, &demo)?)
            })
            .collect::<Result<Vec<_>, BoxError>>()?;
        summary["warm_start_careless_demonstrations"] = json!(slips);
        if slips > 0 {
            println!(
                "the demonstrator answered {slips} of the {} demonstrations from a mental estimate, without the calculator (--demo-slip-rate)",
                samples.len()
            );
        }
        let options = WarmStart {
            steps,
            batch_size: args.parsed("--sft-batch-size")?,
            lr: args.parsed("--sft-lr")?,
            layout,
        };
        let actor = warm_start(model, &samples, &options, |step, loss| {
            if step % 50 == 0 || step + 1 == steps {
                println!("warm-start step {step:>4}/{steps}: loss {loss:.4}");
            }
        })?;
        let weights = actor.export(DType::F32)?;
        model = actor.model().clone();
        save_hf_checkpoint(&weights, &model_dir, &out.join("warm_start"))?;
        engine.update_weights(&weights, WeightVersion(0)).await?;
        println!(
            "supervised warm-start: {steps} steps in {:.0} s",
            t.elapsed().as_secs_f64()
        );
        summary["reward_after_warm_start"] = json!(eval_now("after the warm-start").await?);
    }

    // 5. GRPO through the agent.
    let mut train_config = TrainConfig {
        lr_schedule: miles_train::LrSchedule {
            lr: args.parsed("--lr")?,
            ..Default::default()
        },
        advantage: AdvantageConfig {
            advantage_estimator: AdvantageEstimator::Grpo,
            ..AdvantageConfig::default()
        }
        .with_n_samples_per_prompt(n),
        micro_batch_size: 64,
        layout,
        use_routing_replay: use_r3,
        ..TrainConfig::default()
    };
    let p = &mut train_config.policy_loss;
    p.eps_clip = args.parsed("--eps-clip")?;
    p.eps_clip_high = Some(args.parsed("--eps-clip-high")?);
    p.use_tis = args.boolean("--use-tis")?;
    let actor = Actor::new(model, train_config)?;
    let trainer: SharedTrainer = Arc::new(Mutex::new(Box::new(actor) as Box<dyn PolicyTrainer>));
    let metrics_path = out.join("metrics.jsonl");
    let progress = Arc::new(ProgressSink::new(num_rollout, "eval/calculator/raw_reward"));
    let sink: Arc<dyn MetricsSink> = Arc::new(miles_core::FanoutMetricsSink::new(vec![
        Arc::new(JsonlMetricsSink::create(&metrics_path)?),
        progress.clone(),
    ]));
    let data = DataSource::new(
        split.train.iter().map(MulProblem::prompt_record).collect(),
        n,
        true,
        seed,
    )?;
    let loop_config = LoopConfig {
        num_rollout,
        max_weight_staleness: Some(args.parsed("--max-weight-staleness")?),
        ..LoopConfig::default()
    };
    let mut rl = RlLoop::new(loop_config, manager, trainer.clone(), sink.clone(), data)?
        .with_eval(vec![eval_set()], args.parsed("--eval-interval")?);
    let sync = args.flag("--sync");
    println!(
        "GRPO through the agent: {num_rollout} steps × {} prompts × {n} runs, {} loop, TIS {}, R3 {use_r3}",
        args.required("--rollout-batch-size")?,
        if sync {
            "synchronous"
        } else {
            "fully asynchronous"
        },
        args.boolean("--use-tis")?,
    );
    let t = Instant::now();
    if sync {
        rl.run_sync().await?;
    } else {
        rl.run_async().await?;
    }
    progress.finish();
    sink.flush()?;
    summary["grpo_seconds"] = json!(t.elapsed().as_secs_f64());
    let final_reward = eval_now("after GRPO").await?;
    summary["reward_final"] = json!(final_reward);

    // 6. Outputs and the TITO check.
    summary["weight_version"] = json!(write_final_outputs(
        &trainer,
        &model_dir,
        &out,
        "eval/calculator/raw_reward"
    )?);
    let tito = reward.tito_counts();
    let rate = |k: u64| {
        if tito.checked == 0 {
            f64::NAN
        } else {
            k as f64 / tito.checked as f64
        }
    };
    summary["tito_sessions_checked"] = json!(tito.checked);
    summary["tito_sessions_unfinished"] = json!(tito.unfinished);
    summary["tito_sessions_unrenderable"] = json!(tito.unrenderable);
    summary["tito_mismatch_rate"] = json!(rate(tito.hard));
    summary["tito_assistant_text_rate"] = json!(rate(tito.assistant_text));
    summary["total_seconds"] = json!(started.elapsed().as_secs_f64());
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    println!(
        "TITO mismatch rate: {:.4} ({} of {} finished sessions have a hard mismatch between their token ids and a fresh render of their messages); tolerated assistant_text differences: {:.4}; not compared: {} sessions that ended on the token limit mid-message, {} where the model generated <|im_start|> / <|endoftext|>",
        rate(tito.hard),
        tito.hard,
        tito.checked,
        rate(tito.assistant_text),
        tito.unfinished,
        tito.unrenderable,
    );
    println!(
        "done in {:.0} s: held-out reward {:.3} → {final_reward:.3}; wrote {}/{{metrics.jsonl, curves.svg, final/, summary.json}}",
        started.elapsed().as_secs_f64(),
        summary["reward_initial"].as_f64().unwrap_or(f64::NAN),
        out.display()
    );
    if tito.checked == 0 || tito.hard > 0 {
        return Err("TITO check failed: sessions were not checked or had mismatches".into());
    }
    Ok(())
}
