//! # glm_moe_grpo — the reference binary
//!
//! GRPO on a small GLM-4-MoE through the whole miles-rs stack, on one CPU machine:
//!
//! prompts (JSONL) → embedded engine rollout (continuous batching, log-probs recomputed with the
//! trainer's scoring, routed experts) → rewards → GRPO with TIS and rollout routing replay (R3)
//! → versioned in-place weight update → next rollout; fully asynchronous by default (`--sync`
//! for the synchronous loop), with staleness control, checkpoints and `--resume`.
//!
//! The default task is two-digit addition (`12+35=` → `47`) on a model built from a config,
//! with a byte-level BPE tokenizer and Qwen3's chat template written next to it (an ordinary HF
//! model directory). A short supervised warm-start on 1,000 demonstrations teaches the answer
//! format and most of the arithmetic; it is reported as such. The demonstrator is careless
//! (`--demo-slip-rate 0.3`: 30 % of the problems that carry are demonstrated with every carry
//! forgotten), and the warm-start imitates its slips too. GRPO then practises on the 2,800
//! other training problems, whose answers it is never shown: only the reward, which checks the
//! true sum, sees them.
//! Held-out prompts (disjoint from both) are evaluated (sampled like the rollout, as Miles
//! does, and greedily) before anything, after the warm-start and during / after GRPO.
//!
//! ```text
//! cargo run --release --example glm_moe_grpo                 # defaults, ~5 min on 2 idle cores
//! cargo run --release --example glm_moe_grpo -- --sft-steps 5100 --num-rollout 0   # the ablation: GRPO's time spent on the warm-start
//! cargo run --release --example glm_moe_grpo -- --help       # every flag
//! cargo run --release --example glm_moe_grpo -- --sync
//! cargo run --release --example glm_moe_grpo -- --hf-checkpoint DIR          # a real GLM-4-MoE / Qwen3
//! cargo run --release --example glm_moe_grpo -- --engine-url http://h:30000   # SGLang servers
//! cargo run --release --example glm_moe_grpo -- --resume runs/glm_moe_grpo    # after a kill
//! # on-policy distillation of a GRPO-trained checkpoint into the same warm-start, no reward:
//! cargo run --release --example glm_moe_grpo -- --output-dir runs/opd --use-opd \
//!     --opd-teacher-load runs/glm_moe_grpo/final --distillation-only
//! ```
//!
//! Writes to `--output-dir`: `model/` (the initial HF directory), `data/` (train / held-out
//! JSONL), `metrics.jsonl`, `checkpoints/step_*/` (trainer + rollout state), `final/` (the trained
//! HF checkpoint), `curves.svg` (reward / KL / entropy) and `summary.json`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::Module;
use miles_bridge::{CausalLm, Precision};
use miles_core::rng::SplitMix64;
use miles_core::{
    DType, InferenceEngine, JsonlMetricsSink, MetricsSink, PolicyTrainer, Reward, RewardFn, Sample,
    SamplingParams, WeightVersion,
};
use miles_examples::addition::{AdditionProblem, AdditionReward, AdditionTask, write_jsonl};
use miles_examples::args::{Args, Cli, exit_code, parse_env};
use miles_examples::sft::{WarmStart, warm_start};
use miles_examples::toy::{ToyModelSpec, write_model_dir};
use miles_examples::wiring::{
    ProgressSink, embedded_engine, held_out_reward, save_hf_checkpoint, write_final_outputs,
};
use miles_ops::{AdvantageConfig, AdvantageEstimator};
use miles_rollout::opd::DistillationOnlyReward;
use miles_rollout::{
    ChatPromptEncoder, DataSource, EvalSet, LoopConfig, PromptEncoder, RlLoop, RolloutConfig,
    RolloutManager, SharedTrainer,
};
use miles_train::{Actor, BatchLayout, LrSchedule, OpdConfig, OpdType, TrainConfig};
use serde_json::json;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ABOUT: &str = "GRPO on a small GLM-4-MoE, end to end: embedded-engine rollout with \
log-probs and routed experts, rewards, GRPO with TIS and rollout routing replay, versioned \
weight updates, fully async by default. Flags use Miles' names where Miles has them.";

fn cli() -> Cli {
    Cli::new("glm_moe_grpo", ABOUT)
        .option("--output-dir", "DIR", Some("runs/glm_moe_grpo"), "where the run writes everything")
        .option("--hf-checkpoint", "DIR", None, "start from this HF GLM-4-MoE / Qwen3 / Qwen3-MoE / Qwen2 / Llama / DeepSeek-V3 checkpoint (its tokenizer and chat template) instead of building the small GLM-4-MoE")
        .multi("--engine-url", "URL", "roll out on this SGLang-compatible server instead of the embedded engine (repeatable; a router spreads the load; the servers must see --output-dir for weight updates)")
        .option("--resume", "DIR", None, "continue a killed run from its latest checkpoint in DIR (its output dir)")
        .flag("--sync", "synchronous loop (rollout → train → update) instead of fully asynchronous")
        .option("--num-rollout", "N", Some("200"), "GRPO steps (0: none, the warm-start only)")
        .option("--rollout-batch-size", "N", Some("32"), "prompts per step")
        .option("--n-samples-per-prompt", "N", Some("8"), "samples per prompt (the GRPO group)")
        .option("--advantage-estimator", "NAME", Some("grpo"), "grpo | gspo | reinforce_plus_plus | reinforce_plus_plus_baseline")
        .option("--eps-clip", "X", Some("0.2"), "PPO clip (low side)")
        .option("--eps-clip-high", "X", Some("0.28"), "PPO clip (high side)")
        .option("--use-tis", "BOOL", Some("true"), "truncated importance sampling on the rollout / trainer mismatch")
        .option("--tis-clip", "X", Some("2.0"), "TIS upper clip")
        .option("--use-rollout-routing-replay", "BOOL", Some("true"), "record routed experts at rollout and replay them in training (R3)")
        .option("--use-kl-loss", "BOOL", Some("false"), "KL loss to the reference (the warm-started model)")
        .option("--kl-loss-coef", "X", Some("0.0"), "KL loss weight")
        .option("--entropy-coef", "X", Some("0.0"), "entropy bonus weight")
        .option("--lr", "LR", Some("1e-4"), "GRPO learning rate (AdamW, a fresh optimizer; 3e-4 and up degrade the warm-started model's held-out reward)")
        .option("--lr-warmup-iters", "N", Some("10"), "GRPO optimizer steps of linear learning-rate warm-up from 0")
        .option("--num-steps-per-rollout", "N", Some("1"), "optimizer steps per rollout batch (the batch is split into this many mini-batches)")
        .option("--batch-layout", "NAME", Some("padded"), "how training micro-batches are laid out: padded | packed | per_sample | shared_prefix (equal up to float rounding; padded is fastest for short samples on CPU, shared_prefix for groups sharing a prompt)")
        .option("--max-weight-staleness", "N", Some("1"), "samples older than this many weight versions are regenerated")
        .option("--update-weights-interval", "N", Some("1"), "push weights to the engines every N steps")
        .option("--save-interval", "N", Some("10"), "checkpoint every N steps")
        .option("--keep-checkpoints", "N", None, "keep only the newest N checkpoints (default: all)")
        .flag("--use-tensorboard", "also write TensorBoard event files (every metric of metrics.jsonl, step = rollout id); feed them to wandb with `wandb sync --sync-tensorboard DIR`")
        .option("--tensorboard-dir", "DIR", None, "where the TensorBoard files go (default: $TENSORBOARD_DIR, else OUTPUT/tensorboard)")
        .option("--eval-interval", "N", Some("20"), "evaluate the held-out prompts every N steps")
        .option("--rollout-temperature", "T", Some("1.0"), "sampling temperature")
        .option("--eval-temperature", "T", None, "held-out sampling temperature (default: the rollout temperature, as Miles; 0 = greedy)")
        .option("--n-samples-per-eval-prompt", "N", Some("4"), "samples per held-out prompt (the reward is their mean)")
        .option("--rollout-max-response-len", "N", Some("8"), "response token limit")
        .option("--sft-steps", "N", Some("1500"), "supervised warm-start steps before GRPO (0 = none)")
        .option("--sft-batch-size", "N", Some("64"), "problems per warm-start step")
        .option("--sft-lr", "LR", Some("3e-3"), "warm-start peak learning rate (cosine-decayed to a tenth; the result is saved to OUTPUT/warm_start/)")
        .option("--sft-problems", "KIND", Some("all"), "which training problems the warm-start demonstrates: all | no-carry (no column carries) | one-digit (both operands of one digit) | easy (no-carry or one-digit)")
        .option("--num-sft-prompts", "N", Some("1000"), "warm-start demonstrations: the first N training problems of --sft-problems (0 = all of them)")
        .option("--demo-slip-rate", "P", Some("0.3"), "the demonstrator is careless: each demonstrated problem that carries is, with probability P, answered with every carry dropped (27+15 → 32); fixed per problem, seeded. GRPO's reward and the held-out evaluation check the true sum")
        .option("--partial-credit", "BOOL", Some("false"), "GRPO reward: half credit for digits in the right place (held-out evaluation is exact match either way)")
        .option("--grpo-prompts", "KIND", Some("undemonstrated"), "which training problems GRPO samples: all | undemonstrated (those the warm-start did not demonstrate)")
        .option("--min-digits", "N", Some("2"), "fewest digits of an addend")
        .option("--max-digits", "N", Some("2"), "most digits of an addend")
        .option("--num-train-prompts", "N", Some("3800"), "training problems")
        .option("--num-eval-prompts", "N", Some("200"), "held-out problems")
        .option("--hidden-size", "N", Some("96"), "width of the built GLM-4-MoE")
        .option("--num-layers", "N", Some("3"), "layers of the built GLM-4-MoE (the first dense)")
        .option("--seed", "N", Some("1234"), "seed of data, model and sampling")
        .option("--device", "DEV", Some("flex"), "device of the model, trainer and embedded engine: flex | wgpu[:N] | wgpu-cpu | cuda[:N] (wgpu / cuda need the `wgpu` / `cuda` feature)")
        .flag("--bf16", "GRPO in mixed precision: the trainer's forward in bfloat16 on f32 master weights and AdamW state, the embedded engine's weights and KV cache in bfloat16, weights exported in bfloat16 (Megatron's --bf16; the warm-start stays f32)")
        .flag("--fp16", "the same in float16 (Megatron's --fp16; no loss scaling; not with --bf16)")
        .flag("--use-opd", "on-policy distillation from --opd-teacher-load (Miles' --use-opd --opd-type megatron): the teacher scores each sampled response in the trainer's log-prob pass and `A_t -= opd_kl_coef * (log p_student - log p_teacher)` on top of the estimator's advantages")
        .option("--opd-teacher-load", "DIR", None, "the teacher: an HF checkpoint with the student's vocabulary (e.g. the final/ of an earlier run)")
        .option("--opd-kl-coef", "X", Some("1.0"), "weight of the teacher's reverse KL in the advantages")
        .flag("--distillation-only", "with --use-opd: the task reward is 0 for every sample, the teacher's reverse KL is the only learning signal (held-out evaluation still checks the true sum)")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    // Training allocates and frees large tensors every step: keep freed memory for reuse.
    miles_train::retain_freed_memory();
    match parse_env(&cli()) {
        Ok(args) => exit_code(run(args).await),
        Err(code) => code,
    }
}

struct Setup {
    out: PathBuf,
    model_dir: PathBuf,
    resume: bool,
}

fn setup(args: &Args) -> Result<Setup, BoxError> {
    let resume = args.get("--resume").is_some();
    let out = PathBuf::from(
        args.get("--resume")
            .or(args.get("--output-dir"))
            .unwrap_or("runs/glm_moe_grpo"),
    );
    std::fs::create_dir_all(&out)?;
    let model_dir = match args.get("--hf-checkpoint") {
        Some(dir) => PathBuf::from(dir),
        None => out.join("model"),
    };
    if resume && !out.join("checkpoints").exists() {
        return Err(format!("--resume {}: no checkpoints/ there", out.display()).into());
    }
    Ok(Setup {
        out,
        model_dir,
        resume,
    })
}

async fn run(args: Args) -> Result<(), BoxError> {
    let started = Instant::now();
    let Setup {
        out,
        model_dir,
        resume,
    } = setup(&args)?;
    let seed: u64 = args.parsed("--seed")?;
    let n: usize = args.parsed("--n-samples-per-prompt")?;
    let num_rollout: u64 = args.parsed("--num-rollout")?;
    let use_r3 = args.boolean("--use-rollout-routing-replay")?;
    let device = miles_ops::device::parse_device(args.get("--device").unwrap_or("flex"))?;

    // 1. The model directory: built from a config (tokenizer + Qwen3 template + GLM-4-MoE),
    //    or a real HF checkpoint.
    if args.get("--hf-checkpoint").is_none() && !model_dir.join("config.json").exists() {
        let spec = ToyModelSpec {
            hidden_size: args.parsed("--hidden-size")?,
            num_hidden_layers: args.parsed("--num-layers")?,
            intermediate_size: 2 * args.parsed::<usize>("--hidden-size")?,
            ..ToyModelSpec::default()
        };
        let info = write_model_dir(&model_dir, &spec, seed, &device)?;
        println!(
            "built {}: GLM-4-MoE, {} parameters, vocabulary {}",
            model_dir.display(),
            info.num_params,
            info.vocab_size
        );
    }
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), json!(false));
    let encoder = Arc::new(ChatPromptEncoder::load(&model_dir)?.with_kwargs(kwargs));
    let mut eos_ids = miles_engine::read_eos_ids(&model_dir);
    if eos_ids.is_empty() {
        // A config without `eos_token_id`: the tokenizer config's end-of-turn token.
        eos_ids.extend(miles_engine::eos_from_tokenizer_config(&model_dir));
    }
    let model = CausalLm::from_pretrained(&model_dir, &device.clone().autodiff())?;
    let precision = Precision::from_flags(args.flag("--bf16"), args.flag("--fp16"))?;
    if use_r3 && !model.config.has_moe() {
        return Err("--use-rollout-routing-replay needs an MoE model".into());
    }

    // 2. The task: addition problems, disjoint train / held-out sets, as JSONL.
    let task = AdditionTask {
        min_digits: args.parsed("--min-digits")?,
        max_digits: args.parsed("--max-digits")?,
        seed,
    };
    let split = task.split(
        args.parsed("--num-train-prompts")?,
        args.parsed("--num-eval-prompts")?,
    )?;
    write_jsonl(&out.join("data/train.jsonl"), &split.train)?;
    write_jsonl(&out.join("data/held_out.jsonl"), &split.held_out)?;
    let sft_steps: usize = args.parsed("--sft-steps")?;
    let demos = if sft_steps > 0 {
        warm_start_problems(&split.train, &args)?
    } else {
        Vec::new()
    };
    let demo_answers = demonstrated_answers(&demos, args.parsed("--demo-slip-rate")?, seed)?;
    write_demonstrations(&out.join("data/warm_start.jsonl"), &demos, &demo_answers)?;
    let grpo_problems: Vec<AdditionProblem> = match args.get("--grpo-prompts").unwrap_or("all") {
        "all" => split.train.clone(),
        "undemonstrated" => {
            let shown: std::collections::HashSet<_> = demos.iter().collect();
            let rest: Vec<_> = split
                .train
                .iter()
                .filter(|p| !shown.contains(p))
                .copied()
                .collect();
            if rest.is_empty() {
                return Err("--grpo-prompts undemonstrated: every training problem is demonstrated (raise --num-train-prompts or lower --num-sft-prompts)".into());
            }
            rest
        }
        other => {
            return Err(format!("--grpo-prompts {other:?}: expected all or undemonstrated").into());
        }
    };
    let reward = Arc::new(AdditionReward::default());
    // The GRPO reward may give partial credit for digits in place; held-out evaluation is
    // always exact match. Pure distillation trains on the teacher's signal alone.
    let use_opd = args.flag("--use-opd");
    let distillation_only = args.flag("--distillation-only");
    if distillation_only && !use_opd {
        return Err("--distillation-only needs --use-opd".into());
    }
    let teacher_dir = match (use_opd, args.get("--opd-teacher-load")) {
        (true, Some(dir)) => Some(PathBuf::from(dir)),
        (true, None) => return Err("--use-opd needs --opd-teacher-load DIR".into()),
        (false, Some(_)) => return Err("--opd-teacher-load is set but --use-opd is not".into()),
        (false, None) => None,
    };
    let train_reward: Arc<dyn RewardFn> = if distillation_only {
        Arc::new(DistillationOnlyReward)
    } else {
        Arc::new(AdditionReward {
            partial_credit: args.boolean("--partial-credit")?,
        })
    };

    // 3. Engines: the embedded one (scoring with the trainer's function), or SGLang servers.
    let urls = args.all("--engine-url");
    let engine: Arc<dyn InferenceEngine> = if urls.is_empty() {
        embedded_engine(
            model.valid(),
            &model_dir,
            eos_ids.clone(),
            64,
            seed,
            precision,
        )?
    } else {
        let moe_layers = (0..model.config.num_hidden_layers)
            .filter(|&l| model.config.is_moe_layer(l))
            .count();
        // An engine started with --api-key needs the key: MILES_API_KEY.
        Arc::new(miles_examples::wiring::sglang_fleet(
            urls,
            &out.join("weights"),
            Some(model.config.num_hidden_layers).filter(|_| moe_layers > 0),
        )?)
    };

    let sampling = SamplingParams {
        temperature: args.parsed("--rollout-temperature")?,
        stop_token_ids: eos_ids.clone(),
        ..SamplingParams::default()
    };
    let max_response: usize = args.parsed("--rollout-max-response-len")?;
    let rollout_config = RolloutConfig {
        n_samples_per_prompt: n,
        rollout_batch_size: args.parsed("--rollout-batch-size")?,
        max_concurrency: 256,
        sampling: sampling.clone(),
        rollout_max_response_len: max_response,
        rollout_seed: Some(seed),
        return_routed_experts: use_r3,
        ..RolloutConfig::default()
    };
    let manager = Arc::new(RolloutManager::new(
        rollout_config.clone(),
        engine.clone(),
        encoder.clone(),
        train_reward,
    )?);
    // Held-out evaluation samples like the rollout unless --eval-temperature says otherwise
    // (Miles' default), with a fixed seed so that successive evaluations differ only by the
    // weights.
    let eval_temperature: f32 = args
        .parsed_opt("--eval-temperature")?
        .unwrap_or(sampling.temperature);
    let eval_manager = Arc::new(RolloutManager::new(
        RolloutConfig {
            n_samples_per_prompt: args.parsed("--n-samples-per-eval-prompt")?,
            rollout_batch_size: split.held_out.len(),
            sampling: SamplingParams {
                temperature: eval_temperature,
                ..sampling
            },
            rollout_seed: Some(seed ^ 0xE7A1),
            return_routed_experts: false,
            ..rollout_config
        },
        engine.clone(),
        encoder.clone(),
        reward,
    )?);
    let eval_set = || EvalSet {
        name: "addition".into(),
        prompts: split
            .held_out
            .iter()
            .map(AdditionProblem::prompt_record)
            .collect(),
        manager: eval_manager.clone(),
    };
    let eval_now = |label: &'static str| held_out_reward(eval_set(), label);
    // Greedy decoding of each held-out prompt: the second row of the report.
    let greedy_manager = Arc::new(RolloutManager::new(
        RolloutConfig {
            n_samples_per_prompt: 1,
            sampling: SamplingParams {
                temperature: 0.0,
                ..eval_manager.config().sampling.clone()
            },
            ..eval_manager.config().clone()
        },
        engine.clone(),
        encoder.clone(),
        Arc::new(AdditionReward::default()),
    )?);
    let eval_greedy = |label: &'static str| {
        held_out_reward(
            EvalSet {
                manager: greedy_manager.clone(),
                ..eval_set()
            },
            label,
        )
    };

    // 4. Warm start (supervised, reported as such), then the GRPO trainer.
    let mut summary = json!({});
    let mut model = model;
    if !resume {
        summary["reward_initial"] = json!(eval_now("before any training").await?);
        let steps = sft_steps;
        if steps > 0 {
            let t = Instant::now();
            println!(
                "supervised warm-start on {} demonstrations ({} of the {} training problems); GRPO samples {} problems",
                demos.len(),
                args.get("--sft-problems").unwrap_or("all"),
                split.train.len(),
                grpo_problems.len()
            );
            summary["warm_start_demonstrations"] = json!(demos.len());
            let slips = demos
                .iter()
                .zip(&demo_answers)
                .filter(|(p, a)| p.answer() != **a)
                .count();
            summary["warm_start_wrong_demonstrations"] = json!(slips);
            if slips > 0 {
                println!(
                    "the demonstrator forgot the carries of {slips} of the {} demonstrations (--demo-slip-rate)",
                    demos.len()
                );
            }
            let sft = addition_warm_start(
                model,
                &demos,
                &demo_answers,
                encoder.as_ref(),
                &eos_ids,
                &args,
            )?;
            let weights = sft.export(DType::F32)?;
            model = sft.model().clone();
            save_hf_checkpoint(&weights, &model_dir, &out.join("warm_start"))?;
            println!(
                "supervised warm-start: {steps} steps in {:.0} s",
                t.elapsed().as_secs_f64()
            );
            engine.update_weights(&weights, WeightVersion(0)).await?;
            summary["reward_after_warm_start"] = json!(eval_now("after the warm-start").await?);
            summary["reward_after_warm_start_greedy"] =
                json!(eval_greedy("after the warm-start, greedy").await?);
            summary["warm_start_seconds"] = json!(t.elapsed().as_secs_f64());
        }
    }
    let estimator: AdvantageEstimator = args
        .get("--advantage-estimator")
        .unwrap_or("grpo")
        .parse()
        .map_err(|e| format!("--advantage-estimator: {e}"))?;
    let layout: BatchLayout = args.parsed("--batch-layout")?;
    let mut train_config = TrainConfig {
        lr_schedule: LrSchedule {
            lr: args.parsed("--lr")?,
            lr_warmup_iters: args.parsed("--lr-warmup-iters")?,
            ..LrSchedule::default()
        },
        num_steps_per_rollout: Some(args.parsed("--num-steps-per-rollout")?),
        advantage: AdvantageConfig {
            advantage_estimator: estimator,
            ..AdvantageConfig::default()
        }
        .with_n_samples_per_prompt(n),
        micro_batch_size: 64,
        layout,
        use_routing_replay: use_r3,
        precision,
        ..TrainConfig::default()
    };
    let p = &mut train_config.policy_loss;
    p.advantage_estimator = estimator;
    p.eps_clip = args.parsed("--eps-clip")?;
    p.eps_clip_high = Some(args.parsed("--eps-clip-high")?);
    p.use_tis = args.boolean("--use-tis")?;
    p.tis_clip = args.parsed("--tis-clip")?;
    p.use_kl_loss = args.boolean("--use-kl-loss")?;
    p.kl_loss_coef = args.parsed("--kl-loss-coef")?;
    p.entropy_coef = args.parsed("--entropy-coef")?;
    if teacher_dir.is_some() {
        train_config.opd = OpdConfig {
            use_opd: true,
            opd_type: OpdType::Megatron,
            opd_kl_coef: args.parsed("--opd-kl-coef")?,
            opd_teacher_load: teacher_dir.clone(),
        };
        summary["opd_kl_coef"] = json!(train_config.opd.opd_kl_coef);
        summary["distillation_only"] = json!(distillation_only);
    }
    let mut actor = Actor::new(model, train_config)?;
    if let Some(dir) = &teacher_dir {
        actor = actor.with_teacher(CausalLm::from_pretrained(dir, &device)?)?;
        summary["opd_teacher"] = json!(dir.display().to_string());
    }
    let trainer: SharedTrainer = Arc::new(Mutex::new(Box::new(actor) as Box<dyn PolicyTrainer>));

    // 5. The loop.
    let metrics_path = out.join("metrics.jsonl");
    let jsonl = if resume {
        JsonlMetricsSink::append(&metrics_path)?
    } else {
        JsonlMetricsSink::create(&metrics_path)?
    };
    let progress = Arc::new(ProgressSink::new(num_rollout, "eval/addition/raw_reward"));
    let mut sinks: Vec<Arc<dyn MetricsSink>> = vec![
        Arc::new(jsonl),
        Arc::new(miles_examples::wiring::CurvesOnEval::new(
            &out,
            "eval/addition/raw_reward",
        )),
        progress.clone(),
    ];
    if args.flag("--use-tensorboard") {
        sinks.push(Arc::new(miles_examples::wiring::tensorboard_sink(
            args.get("--tensorboard-dir"),
            &out,
        )?));
    }
    let sink: Arc<dyn MetricsSink> = Arc::new(miles_core::FanoutMetricsSink::new(sinks));
    let data = DataSource::new(
        grpo_problems
            .iter()
            .map(AdditionProblem::prompt_record)
            .collect(),
        n,
        true,
        seed,
    )?;
    let loop_config = LoopConfig {
        num_rollout,
        update_weights_interval: args.parsed("--update-weights-interval")?,
        max_weight_staleness: Some(args.parsed("--max-weight-staleness")?),
        save_interval: Some(args.parsed("--save-interval")?),
        save: Some(out.join("checkpoints")),
        keep_checkpoints: args.parsed_opt("--keep-checkpoints")?,
        ..LoopConfig::default()
    };
    let mut rl = RlLoop::new(loop_config, manager, trainer.clone(), sink.clone(), data)?
        .with_eval(vec![eval_set()], args.parsed("--eval-interval")?);
    if resume {
        let step = rl.resume().await?;
        for note in rl.resume_notes() {
            println!("resume: {note}");
        }
        println!("resumed at step {step} from {}", out.display());
    }
    let t = Instant::now();
    let sync = args.flag("--sync");
    println!(
        "{}: {num_rollout} steps × {} prompts × {n} samples, {} loop, TIS {}, R3 {}",
        match (use_opd, distillation_only) {
            (true, true) => "on-policy distillation (no task reward)",
            (true, false) => "GRPO + on-policy distillation",
            _ => "GRPO",
        },
        args.get("--rollout-batch-size").unwrap_or("?"),
        if sync {
            "synchronous"
        } else {
            "fully asynchronous"
        },
        args.boolean("--use-tis")?,
        use_r3,
    );
    if sync {
        rl.run_sync().await?;
    } else {
        rl.run_async().await?;
    }
    progress.finish();
    sink.flush()?;
    let grpo_seconds = t.elapsed().as_secs_f64();
    let final_reward = eval_now("after GRPO").await?;
    summary["reward_final_greedy"] = json!(eval_greedy("after GRPO, greedy").await?);

    // 6. Outputs: final checkpoint, curves, summary.
    summary["weight_version"] = json!(write_final_outputs(
        &trainer,
        &model_dir,
        &out,
        "eval/addition/raw_reward"
    )?);
    summary["reward_final"] = json!(final_reward);
    summary["grpo_seconds"] = json!(grpo_seconds);
    summary["total_seconds"] = json!(started.elapsed().as_secs_f64());
    summary["loop"] = json!(if sync { "sync" } else { "async" });
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    println!(
        "done in {:.0} s: held-out reward {} → {final_reward:.3}; wrote {}/{{metrics.jsonl, curves.svg, final/, checkpoints/, summary.json}}",
        started.elapsed().as_secs_f64(),
        summary
            .get("reward_initial")
            .and_then(|v| v.as_f64())
            .map_or("(resumed)".to_string(), |v| format!("{v:.3}")),
        out.display()
    );
    Ok(())
}

/// The training problems the warm-start demonstrates (`--sft-problems`, `--num-sft-prompts`).
fn warm_start_problems(
    train: &[AdditionProblem],
    args: &Args,
) -> Result<Vec<AdditionProblem>, BoxError> {
    let keep: fn(&AdditionProblem) -> bool = match args.get("--sft-problems").unwrap_or("all") {
        "all" => |_| true,
        "no-carry" => |p| !p.has_carry(),
        "one-digit" => |p| p.a < 10 && p.b < 10,
        "easy" => |p| !p.has_carry() || (p.a < 10 && p.b < 10),
        other => {
            return Err(format!(
                "--sft-problems {other:?}: expected all, no-carry, one-digit or easy"
            )
            .into());
        }
    };
    let limit = match args.parsed::<usize>("--num-sft-prompts")? {
        0 => usize::MAX,
        n => n,
    };
    let demos: Vec<AdditionProblem> = train.iter().copied().filter(keep).take(limit).collect();
    if demos.is_empty() {
        return Err("the warm-start has no demonstrations (see --sft-problems)".into());
    }
    Ok(demos)
}

/// The answers the warm-start demonstrates, one per problem: the true sum, except that a
/// problem with a carry is, with probability `slip_rate` (drawn once per problem from the run's
/// seed), answered by a careless labeller who drops every carry.
fn demonstrated_answers(
    problems: &[AdditionProblem],
    slip_rate: f64,
    seed: u64,
) -> Result<Vec<String>, BoxError> {
    if !(0.0..=1.0).contains(&slip_rate) {
        return Err(
            format!("--demo-slip-rate {slip_rate}: expected a probability in [0, 1]").into(),
        );
    }
    let mut rng = SplitMix64::new(seed ^ 0xD3E0_5119);
    Ok(problems
        .iter()
        .map(|p| {
            // One draw per problem whether or not it carries, so the slips of a seed do not
            // depend on which problems carry.
            let unit = rng.next_f64();
            let slip = unit < slip_rate;
            if slip && p.has_carry() {
                p.answer_without_carries()
            } else {
                p.answer()
            }
        })
        .collect())
}

/// `data/warm_start.jsonl`: the demonstrations as the warm-start saw them (`label` is the
/// demonstrated answer, `metadata.true_sum` the correct one).
fn write_demonstrations(
    path: &std::path::Path,
    problems: &[AdditionProblem],
    answers: &[String],
) -> Result<(), BoxError> {
    let mut text = String::new();
    for (p, answer) in problems.iter().zip(answers) {
        let mut line = p.jsonl_value();
        line["label"] = json!(answer);
        line["metadata"]["true_sum"] = json!(p.answer());
        text.push_str(&serde_json::to_string(&line)?);
        text.push('\n');
    }
    std::fs::write(path, text)?;
    Ok(())
}

/// Supervised warm-start: the demonstrated answer and the end-of-turn token after each
/// training prompt. Returns the trained SFT actor.
fn addition_warm_start(
    model: CausalLm,
    problems: &[AdditionProblem],
    answers: &[String],
    encoder: &ChatPromptEncoder,
    eos_ids: &[u32],
    args: &Args,
) -> Result<Actor, BoxError> {
    let steps: usize = args.parsed("--sft-steps")?;
    let eos = *eos_ids.first().ok_or("the model has no EOS token")?;
    let samples: Vec<Sample> = problems
        .iter()
        .zip(answers)
        .map(|(p, answer)| -> Result<Sample, BoxError> {
            let record = p.prompt_record();
            let probe = Sample {
                prompt: record.prompt,
                ..Sample::default()
            };
            let prompt = encoder.encode(&probe)?;
            let mut response = encoder.chat().encode(answer)?;
            response.push(eos);
            Ok(Sample {
                tokens: prompt.iter().chain(&response).copied().collect(),
                response_length: response.len(),
                loss_mask: Some(vec![1; response.len()]),
                reward: Some(Reward::Scalar(0.0)),
                ..Sample::default()
            })
        })
        .collect::<Result<_, _>>()?;
    let options = WarmStart {
        steps,
        batch_size: args.parsed("--sft-batch-size")?,
        lr: args.parsed("--sft-lr")?,
        layout: args.parsed("--batch-layout")?,
    };
    Ok(warm_start(model, &samples, &options, |step, loss| {
        if step % 100 == 0 || step + 1 == steps {
            println!("warm-start step {step:>4}/{steps}: loss {loss:.4}");
        }
    })?)
}
