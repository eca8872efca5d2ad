//! `miles tito`: render chat templates, replay TITO sessions, verify templates and check a
//! model directory from the command line.
//!
//! ```text
//! miles tito render --model DIR [--template FILE] [--tito FAMILY] --messages FILE [--tools FILE] [--kwargs JSON] [--add-generation-prompt]
//! miles tito incremental --model DIR --tito FAMILY --messages FILE [--tools FILE] [--kwargs JSON]
//! miles tito verify --model DIR [--template FILE] [--tito FAMILY] [--thinking on|off|both] [--kwargs JSON] [--trajectories FILE]
//! miles tito check --model DIR [--tito FAMILY] [--template FILE] [--thinking on|off|both] [--kwargs JSON]
//! ```
//!
//! For a DeepSeek checkpoint (`config.json` `model_type` `deepseek_v32` / `deepseek_v4`) or
//! `--tito deepseekv32|deepseekv4`, `render` uses the DeepSeek encoder through Miles' bridge
//! (messages as sent, so `developer` and V4's `latest_reminder` / `task` work too).
//!
//! Exit codes: 0 success (verify / check: all cases pass), 1 verify / check found failures,
//! 2 bad arguments, unreadable files or any other error (one line on stderr).

use std::path::Path;
use std::process::ExitCode;

use miles_core::Message;
use miles_tito::{
    ChatTemplate, HfChat, RenderArgs, ThinkingMode, TitoFamily, TitoTokenizer, VerifyTarget,
    miles_normalise, parse_trajectories, verify,
};
use serde_json::{Map, Value as Json, json};

use crate::args::{TitoCommand, TitoModel};
use crate::template_check::{CheckOptions, check_model_dir};

/// What the `tito` subcommands read, whichever they are.
struct Args<'a> {
    command: &'static str,
    model: &'a TitoModel,
    tito: Option<&'a str>,
    messages: Option<&'a Path>,
    tools: Option<&'a Path>,
    thinking: Option<&'a str>,
    trajectories: Option<&'a Path>,
    add_generation_prompt: bool,
}

impl Args<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        fn path(p: Option<&Path>) -> Option<&str> {
            p.and_then(Path::to_str)
        }
        match key {
            "--model" => self.model.model.to_str(),
            "--template" => path(self.model.template.as_deref()),
            "--kwargs" => self.model.kwargs.as_deref(),
            "--tito" => self.tito,
            "--messages" => path(self.messages),
            "--tools" => path(self.tools),
            "--thinking" => self.thinking,
            "--trajectories" => path(self.trajectories),
            _ => None,
        }
    }

    fn require(&self, key: &str) -> Result<&str, String> {
        self.get(key)
            .ok_or_else(|| format!("{} needs {key} (a UTF-8 path)", self.command))
    }
}

fn read(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))
}

fn read_json_array(path: &str, what: &str) -> Result<Vec<Json>, String> {
    match serde_json::from_str::<Json>(&read(path)?) {
        Ok(Json::Array(items)) => Ok(items),
        Ok(_) => Err(format!("{what} file {path} must hold a JSON array")),
        Err(e) => Err(format!("{what} file {path} is not valid JSON: {e}")),
    }
}

fn kwargs(args: &Args<'_>) -> Result<Map<String, Json>, String> {
    match args.get("--kwargs") {
        None => Ok(Map::new()),
        Some(text) => match serde_json::from_str::<Json>(text) {
            Ok(Json::Object(map)) => Ok(map),
            Ok(_) => Err("--kwargs must be a JSON object".into()),
            Err(e) => Err(format!("--kwargs is not valid JSON: {e}")),
        },
    }
}

fn typed_messages(values: &[Json]) -> Result<Vec<Message>, String> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            serde_json::from_value(v.clone()).map_err(|e| format!("message {i} is invalid: {e}"))
        })
        .collect()
}

fn load(args: &Args<'_>) -> Result<HfChat, String> {
    let chat = HfChat::load(args.require("--model")?).map_err(|e| e.to_string())?;
    match args.get("--template") {
        Some(path) => chat
            .with_template_source(read(path)?)
            .map_err(|e| e.to_string()),
        None => Ok(chat),
    }
}

fn family(args: &Args<'_>) -> Result<Option<TitoFamily>, String> {
    args.get("--tito")
        .map(|name| TitoFamily::parse(name).map_err(|e| e.to_string()))
        .transpose()
}

fn tito(args: &Args<'_>, chat: &HfChat, family: TitoFamily) -> Result<TitoTokenizer, String> {
    let kwargs = kwargs(args)?;
    let result = if args.get("--template").is_some() {
        let template = chat.template(false).map_err(|e| e.to_string())?.clone();
        TitoTokenizer::with_template(chat, template, family, kwargs)
    } else {
        TitoTokenizer::new(chat, family, kwargs)
    };
    result.map_err(|e| e.to_string())
}

fn cmd_render(args: &Args<'_>) -> Result<ExitCode, String> {
    let chat = load(args)?;
    let messages = read_json_array(args.require("--messages")?, "messages")?;
    let tools = args
        .get("--tools")
        .map(|p| read_json_array(p, "tools"))
        .transpose()?;
    let add_generation_prompt = args.add_generation_prompt;
    let out = match family(args)? {
        None => {
            let rendered = chat
                .apply_chat_template(RenderArgs {
                    messages: &messages,
                    tools: tools.as_deref(),
                    add_generation_prompt,
                    kwargs: &kwargs(args)?,
                })
                .map_err(|e| e.to_string())?;
            json!({"text": rendered.text, "ids": rendered.ids})
        }
        Some(family) if args.get("--template").is_some() && family.deepseek_encoder().is_some() => {
            return Err(format!(
                "--tito {family} renders with the DeepSeek encoder and takes no --template"
            ));
        }
        Some(family)
            if family
                .deepseek_encoder()
                .or(chat.deepseek_version())
                .is_some() =>
        {
            // The DeepSeek encoder (the family's, or the checkpoint's model_type) through
            // Miles' bridge, with the family's kwargs; messages as sent.
            let version = family
                .deepseek_encoder()
                .or(chat.deepseek_version())
                .ok_or("no DeepSeek encoder")?;
            let kwargs = family
                .merge_kwargs(kwargs(args)?)
                .map_err(|e| e.to_string())?;
            let text = version
                .apply_chat_template(&messages, tools.as_deref(), add_generation_prompt, &kwargs)
                .map_err(|e| e.to_string())?;
            let ids = match chat.tokenizer() {
                Some(_) => Some(chat.encode(&text).map_err(|e| e.to_string())?),
                None => None,
            };
            json!({"text": text, "ids": ids})
        }
        Some(family) => {
            // The family's template (unless --template overrides it), forced kwargs and
            // Miles' message normalisation; ids only when the directory has a tokenizer.
            let template = match (args.get("--template"), family.fixed_template()) {
                (None, Some((_, source))) => ChatTemplate::new(source)
                    .map_err(|e| e.to_string())?
                    .with_special_tokens(chat.special_tokens().clone()),
                _ => chat.template(false).map_err(|e| e.to_string())?.clone(),
            };
            let kwargs = family
                .merge_kwargs(kwargs(args)?)
                .map_err(|e| e.to_string())?;
            let typed = typed_messages(&messages)?;
            let normalised = miles_normalise(&typed).map_err(|e| e.to_string())?;
            let tools = tools.as_deref().map(miles_tito::canonical_tools);
            let text = template
                .render(RenderArgs {
                    messages: &normalised,
                    tools: tools.as_deref(),
                    add_generation_prompt,
                    kwargs: &kwargs,
                })
                .map_err(|e| e.to_string())?;
            let ids = match chat.tokenizer() {
                Some(_) => Some(chat.encode(&text).map_err(|e| e.to_string())?),
                None => None,
            };
            json!({"text": text, "ids": ids})
        }
    };
    println!("{out}");
    Ok(ExitCode::SUCCESS)
}

fn cmd_incremental(args: &Args<'_>) -> Result<ExitCode, String> {
    let chat = load(args)?;
    let family = family(args)?.ok_or("incremental needs --tito")?;
    let tito = tito(args, &chat, family)?;
    let messages = typed_messages(&read_json_array(args.require("--messages")?, "messages")?)?;
    let tools = args
        .get("--tools")
        .map(|p| read_json_array(p, "tools"))
        .transpose()?;
    let trajectory = tito
        .replay_conversation(&messages, tools.as_deref())
        .map_err(|e| e.to_string())?;
    let out = json!({
        "ids": trajectory.ids(),
        "loss_mask": trajectory.loss_mask(),
        "turns": trajectory.turns(),
    });
    println!("{out}");
    Ok(ExitCode::SUCCESS)
}

fn cmd_verify(args: &Args<'_>) -> Result<ExitCode, String> {
    let chat = load(args)?;
    let thinking =
        ThinkingMode::parse(args.get("--thinking").unwrap_or("on")).map_err(|e| e.to_string())?;
    let trajectories = match args.get("--trajectories") {
        Some(path) => parse_trajectories(&read(path)?),
        None => parse_trajectories(miles_tito::DEFAULT_TRAJECTORIES),
    }
    .map_err(|e| e.to_string())?;
    let source = args
        .get("--template")
        .map(str::to_owned)
        .unwrap_or_else(|| chat.dir().display().to_string());
    let report = match family(args)? {
        None => {
            let template = chat.template(false).map_err(|e| e.to_string())?;
            verify(
                &VerifyTarget::Raw {
                    template,
                    kwargs: kwargs(args)?,
                    source,
                },
                &trajectories,
                thinking,
            )
        }
        Some(family) => {
            let tito = tito(args, &chat, family)?;
            let source = match (
                args.get("--template"),
                family.fixed_template(),
                tito.deepseek_version(),
            ) {
                (_, _, Some(version)) => format!("{version} encoder (--tito {family})"),
                (None, Some((name, _)), None) => {
                    format!("{name} (fixed template of --tito {family})")
                }
                _ => source,
            };
            verify(
                &VerifyTarget::Tito {
                    tito: &tito,
                    kwargs: kwargs(args)?,
                    source,
                },
                &trajectories,
                thinking,
            )
        }
    }
    .map_err(|e| e.to_string())?;
    print!("{}", report.render());
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The arguments of `command` with only the model given.
fn base<'a>(command: &'static str, model: &'a TitoModel) -> Args<'a> {
    Args {
        command,
        model,
        tito: None,
        messages: None,
        tools: None,
        thinking: None,
        trajectories: None,
        add_generation_prompt: false,
    }
}

/// Runs `miles tito COMMAND`: the exit status (0, or 1 when verification found failures),
/// or the error as one line.
pub fn run(command: &TitoCommand) -> Result<ExitCode, String> {
    match command {
        TitoCommand::Render {
            model,
            tito,
            messages,
            tools,
            add_generation_prompt,
        } => cmd_render(&Args {
            tito: tito.as_deref(),
            messages: Some(messages),
            tools: tools.as_deref(),
            add_generation_prompt: *add_generation_prompt,
            ..base("render", model)
        }),
        TitoCommand::Incremental {
            model,
            tito,
            messages,
            tools,
        } => cmd_incremental(&Args {
            tito: Some(tito),
            messages: Some(messages),
            tools: tools.as_deref(),
            ..base("incremental", model)
        }),
        TitoCommand::Verify {
            model,
            tito,
            thinking,
            trajectories,
        } => cmd_verify(&Args {
            tito: tito.as_deref(),
            thinking: Some(thinking),
            trajectories: trajectories.as_deref(),
            ..base("verify", model)
        }),
        TitoCommand::Check {
            model,
            tito,
            thinking,
            trajectories,
        } => cmd_check(model, tito.as_deref(), thinking, trajectories.as_deref()),
    }
}

/// `tito check`: tokenizer checks plus the verifier in raw and TITO mode.
fn cmd_check(
    model: &TitoModel,
    tito: Option<&str>,
    thinking: &str,
    trajectories: Option<&Path>,
) -> Result<ExitCode, String> {
    let mut options = CheckOptions::new(&model.model);
    options.family = tito
        .map(TitoFamily::parse)
        .transpose()
        .map_err(|e| format!("--tito: {e}"))?;
    options.template = model.template.clone();
    options.thinking = ThinkingMode::parse(thinking).map_err(|e| format!("--thinking: {e}"))?;
    options.trajectories = trajectories.map(Path::to_path_buf);
    if let Some(text) = &model.kwargs {
        match serde_json::from_str::<Json>(text) {
            Ok(Json::Object(map)) => options.kwargs = map,
            _ => return Err("--kwargs must be a JSON object".into()),
        }
    }
    let check = check_model_dir(&options).map_err(|e| e.to_string())?;
    print!("{}", check.render());
    Ok(if check.tito_safe() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
