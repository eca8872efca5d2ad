//! Loading a model directory the way HF transformers does.
//!
//! [`HfChat`] reads `tokenizer.json` (optional: without it only text rendering is possible),
//! `tokenizer_config.json` (special tokens; `chat_template` as a string or as a named list
//! `[{"name": …, "template": …}]`) and `chat_template.jinja` (which, as in transformers, takes
//! precedence over the config's template), plus any `additional_chat_templates/NAME.jinja`.
//!
//! As in Miles (`template.py`, its first rule), a directory whose `config.json` `model_type`
//! is `deepseek_v32` or `deepseek_v4` renders with that DeepSeek encoder (see
//! [`DeepSeekVersion`]) instead of a chat template.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use crate::args::RenderArgs;
use crate::deepseek::DeepSeekVersion;
use crate::error::{Error, Result};
use crate::fastdec::FastDecoder;
use crate::fastenc::FastEncoder;
use crate::hf;
use crate::template::{ChatTemplate, TemplateClock};

/// The special-token attributes HF passes to templates, in `special_tokens_map` order.
pub const SPECIAL_TOKEN_ATTRIBUTES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A model directory's chat template(s), special tokens and (optional) tokenizer.
#[derive(Debug, Clone)]
pub struct HfChat {
    dir: PathBuf,
    default_template: Option<ChatTemplate>,
    named_templates: BTreeMap<String, ChatTemplate>,
    special_tokens: Map<String, Json>,
    tokenizer: Option<Arc<Tokenizer>>,
    fast: Option<Arc<FastEncoder>>,
    fast_decoder: Option<Arc<FastDecoder>>,
    model_type: Option<String>,
    deepseek: Option<DeepSeekVersion>,
}

/// Output of [`HfChat::apply_chat_template`]: the rendered text and, when a tokenizer is
/// loaded, its ids (`add_special_tokens=False`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Rendered {
    /// The rendered prompt text.
    pub text: String,
    /// Token ids of `text`, or `None` without a tokenizer.
    pub ids: Option<Vec<u32>>,
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })
}

/// `config.json`'s `model_type`, read as Miles does: a missing, unreadable or malformed file,
/// or a non-string value, is no model type.
fn read_model_type(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let config: Json = serde_json::from_str(&text).ok()?;
    config
        .get("model_type")
        .and_then(Json::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// A special-token value from `tokenizer_config.json`: a string, or an `AddedToken` object
/// with `content`.
fn token_text(value: &Json) -> Option<String> {
    match value {
        Json::String(s) => Some(s.clone()),
        Json::Object(map) => map.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

impl HfChat {
    /// Loads `dir` (see the module docs). A directory without any chat template loads, but
    /// rendering then fails with [`Error::NoChatTemplate`].
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_owned();
        if !dir.is_dir() {
            return Err(Error::Io {
                path: dir,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a directory"),
            });
        }
        let config_path = dir.join("tokenizer_config.json");
        let config: Map<String, Json> = if config_path.exists() {
            match serde_json::from_str(&read_text(&config_path)?) {
                Ok(Json::Object(map)) => map,
                Ok(_) => return Err(Error::json("tokenizer_config.json", "not an object")),
                Err(e) => return Err(Error::json("tokenizer_config.json", e)),
            }
        } else {
            Map::new()
        };
        let mut special_tokens = Map::new();
        for attr in SPECIAL_TOKEN_ATTRIBUTES {
            if let Some(text) = config.get(attr).and_then(token_text) {
                special_tokens.insert(attr.to_owned(), Json::String(text));
            }
        }
        let map_path = dir.join("special_tokens_map.json");
        if map_path.exists() {
            let map: Json = serde_json::from_str(&read_text(&map_path)?)
                .map_err(|e| Error::json("special_tokens_map.json", e))?;
            for attr in SPECIAL_TOKEN_ATTRIBUTES {
                if let Some(text) = map.get(attr).and_then(token_text) {
                    special_tokens.insert(attr.to_owned(), Json::String(text));
                }
            }
        }

        let mut default_source = None;
        let mut named_sources = BTreeMap::new();
        match config.get("chat_template") {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) => default_source = Some(s.clone()),
            Some(Json::Array(entries)) => {
                for entry in entries {
                    let name = entry.get("name").and_then(Json::as_str);
                    let template = entry.get("template").and_then(Json::as_str);
                    match (name, template) {
                        (Some(name), Some(template)) => {
                            named_sources.insert(name.to_owned(), template.to_owned());
                        }
                        _ => {
                            return Err(Error::json(
                                "tokenizer_config.json chat_template",
                                "list entries need string `name` and `template`",
                            ));
                        }
                    }
                }
            }
            Some(_) => {
                return Err(Error::json(
                    "tokenizer_config.json chat_template",
                    "must be a string or a list of {name, template}",
                ));
            }
        }
        let jinja_path = dir.join("chat_template.jinja");
        if jinja_path.exists() {
            default_source = Some(read_text(&jinja_path)?);
        }
        let extra_dir = dir.join("additional_chat_templates");
        if let Ok(entries) = std::fs::read_dir(&extra_dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if path.extension().and_then(|e| e.to_str()) == Some("jinja")
                    && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
                {
                    named_sources.insert(stem.to_owned(), read_text(&path)?);
                }
            }
        }
        if let Some(source) = default_source {
            named_sources.remove("default");
            named_sources.insert("default".into(), source);
        }
        let mut named_templates = BTreeMap::new();
        for (name, source) in named_sources {
            named_templates.insert(
                name,
                ChatTemplate::new(source)?.with_special_tokens(special_tokens.clone()),
            );
        }
        let default_template = named_templates.get("default").cloned();

        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer = if tokenizer_path.exists() {
            Some(Arc::new(Tokenizer::from_file(&tokenizer_path).map_err(
                |e| Error::Tokenizer(format!("{}: {e}", tokenizer_path.display())),
            )?))
        } else {
            None
        };
        let fast = tokenizer.clone().and_then(FastEncoder::new).map(Arc::new);
        let fast_decoder = tokenizer.as_deref().and_then(crate::fastdec::shared);
        let model_type = read_model_type(&dir);
        let deepseek = model_type
            .as_deref()
            .and_then(DeepSeekVersion::from_model_type);
        Ok(Self {
            dir,
            default_template,
            named_templates,
            special_tokens,
            tokenizer,
            fast,
            fast_decoder,
            model_type,
            deepseek,
        })
    }

    /// Replaces the chat template with `source` (what `--template FILE` or
    /// `apply_chat_template(chat_template=…)` does). An explicit template also takes the place
    /// of a DeepSeek encoder.
    pub fn with_template_source(mut self, source: impl Into<String>) -> Result<Self> {
        let template = ChatTemplate::new(source)?.with_special_tokens(self.special_tokens.clone());
        self.deepseek = None;
        self.named_templates.clear();
        self.named_templates
            .insert("default".into(), template.clone());
        self.default_template = Some(template);
        Ok(self)
    }

    /// The same directory with every template's `strftime_now` reading `clock`.
    pub fn with_clock(mut self, clock: TemplateClock) -> Result<Self> {
        for template in self.named_templates.values_mut() {
            *template = template.clone().with_clock(clock)?;
        }
        self.default_template = self.named_templates.get("default").cloned();
        Ok(self)
    }

    /// The directory this was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`'s `model_type`, when the directory has one.
    pub fn model_type(&self) -> Option<&str> {
        self.model_type.as_deref()
    }

    /// The DeepSeek encoder this directory renders with (`model_type` `deepseek_v32` or
    /// `deepseek_v4`, unless a template was set with [`HfChat::with_template_source`]).
    pub fn deepseek_version(&self) -> Option<DeepSeekVersion> {
        self.deepseek
    }

    /// The special-token variables passed to templates.
    pub fn special_tokens(&self) -> &Map<String, Json> {
        &self.special_tokens
    }

    /// The tokenizer, when the directory has a `tokenizer.json`.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// The accelerated id-exact encoder, when the tokenizer's pipeline is one
    /// [`FastEncoder`] reproduces (Qwen2/3, Llama 3, GLM-4.x byte-level BPE).
    pub fn fast_encoder(&self) -> Option<&Arc<FastEncoder>> {
        self.fast.as_ref()
    }

    /// The table-driven text-exact decoder, when the tokenizer's decoder is `ByteLevel`.
    pub fn fast_decoder(&self) -> Option<&Arc<FastDecoder>> {
        self.fast_decoder.as_ref()
    }

    /// Names of the available templates (`default` for the main one).
    pub fn template_names(&self) -> Vec<&str> {
        self.named_templates.keys().map(String::as_str).collect()
    }

    /// The template HF would pick: with tools, a template named `tool_use` if there is one;
    /// otherwise `default`.
    pub fn template(&self, with_tools: bool) -> Result<&ChatTemplate> {
        if with_tools && let Some(t) = self.named_templates.get("tool_use") {
            return Ok(t);
        }
        self.default_template.as_ref().ok_or_else(|| {
            Error::NoChatTemplate(if self.named_templates.is_empty() {
                format!("{} has no chat template", self.dir.display())
            } else {
                format!(
                    "{} has named templates {:?} but none is named 'default'",
                    self.dir.display(),
                    self.template_names()
                )
            })
        })
    }

    /// A template by name.
    pub fn named_template(&self, name: &str) -> Result<&ChatTemplate> {
        self.named_templates
            .get(name)
            .ok_or_else(|| Error::NoChatTemplate(format!("no template named {name:?}")))
    }

    /// Renders with the HF-selected template, or with the DeepSeek encoder for a DeepSeek
    /// checkpoint (Miles' bridge: [`DeepSeekVersion::apply_chat_template`]).
    pub fn render(&self, args: RenderArgs<'_>) -> Result<String> {
        if let Some(version) = self.deepseek {
            return version.apply_chat_template(
                args.messages,
                args.tools,
                args.add_generation_prompt,
                args.kwargs,
            );
        }
        self.template(args.tools.is_some())?.render(args)
    }

    /// Encodes text without adding special tokens (what `apply_chat_template(tokenize=True)`
    /// does after rendering).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        if let Some(fast) = &self.fast {
            return fast.encode(text);
        }
        let tokenizer = self.tokenizer.as_ref().ok_or(Error::NoTokenizer)?;
        hf::encode(tokenizer, text)
    }

    /// Renders, then encodes when a tokenizer is loaded.
    pub fn apply_chat_template(&self, args: RenderArgs<'_>) -> Result<Rendered> {
        let text = self.render(args)?;
        let ids = match &self.tokenizer {
            Some(_) => Some(self.encode(&text)?),
            None => None,
        };
        Ok(Rendered { text, ids })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("miles-tito-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn render_one(chat: &HfChat, tools: bool) -> String {
        let messages = vec![json!({"role": "user", "content": "hi"})];
        let tool_list = vec![json!({"type": "function", "function": {"name": "f"}})];
        chat.render(RenderArgs {
            messages: &messages,
            tools: tools.then_some(tool_list.as_slice()),
            add_generation_prompt: false,
            kwargs: &Map::new(),
        })
        .unwrap()
    }

    #[test]
    fn config_string_template_and_added_token_objects() {
        let dir = temp_dir("cfg-string");
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({
                "bos_token": {"__type": "AddedToken", "content": "<s>"},
                "eos_token": "</s>", "unk_token": null,
                "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ unk_token is defined }}"
            })
            .to_string(),
        )
        .unwrap();
        let chat = HfChat::load(&dir).unwrap();
        assert!(chat.tokenizer().is_none());
        assert_eq!(render_one(&chat, false), "<s>hi</s>False");
        assert!(matches!(chat.encode("x"), Err(Error::NoTokenizer)));
    }

    #[test]
    fn named_template_list_selects_tool_use_with_tools() {
        let dir = temp_dir("cfg-list");
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({"chat_template": [
                {"name": "default", "template": "D"},
                {"name": "tool_use", "template": "T"}
            ]})
            .to_string(),
        )
        .unwrap();
        let chat = HfChat::load(&dir).unwrap();
        assert_eq!(render_one(&chat, false), "D");
        assert_eq!(render_one(&chat, true), "T");
        assert_eq!(chat.template_names(), vec!["default", "tool_use"]);
        // chat_template.jinja wins over the config's default.
        std::fs::write(dir.join("chat_template.jinja"), "J\n").unwrap();
        let chat = HfChat::load(&dir).unwrap();
        assert_eq!(render_one(&chat, false), "J");
        assert_eq!(render_one(&chat, true), "T");
    }

    #[test]
    fn missing_template_is_a_typed_error() {
        let dir = temp_dir("no-template");
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({"chat_template": [{"name": "rag", "template": "R"}]}).to_string(),
        )
        .unwrap();
        let chat = HfChat::load(&dir).unwrap();
        let messages = vec![json!({"role": "user", "content": "hi"})];
        let err = chat
            .render(RenderArgs {
                messages: &messages,
                tools: None,
                add_generation_prompt: false,
                kwargs: &Map::new(),
            })
            .unwrap_err();
        assert!(matches!(err, Error::NoChatTemplate(_)));
        std::fs::write(dir.join("tokenizer_config.json"), "{not json").unwrap();
        assert!(matches!(HfChat::load(&dir), Err(Error::Json { .. })));
    }
}
