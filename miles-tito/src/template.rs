//! Chat-template rendering configured like HF transformers' sandbox.
//!
//! [`ChatTemplate`] compiles a Jinja chat template with minijinja set up the way
//! `transformers.utils.chat_template_utils` sets up Jinja2: `trim_blocks` and
//! `lstrip_blocks` on, loop controls, Python `str`/`dict`/`list` methods (minijinja-contrib
//! `pycompat`), HF's `tojson` (`json.dumps` with `ensure_ascii=False` and Python's
//! separators), `raise_exception`, `strftime_now`, `namespace` and `dict`, and values printed
//! the way Python prints them (`None`, `True`, `{'a': 1}`). Before rendering, messages are
//! normalised exactly as `apply_chat_template` does: keys whose value is `null` are dropped
//! and the reasoning aliases (`thinking`, `reasoning_content`) are filled in. Mutating methods
//! such as `list.append` do not exist, matching HF's immutable sandbox: such templates fail
//! with [`Error::Render`] where HF raises `SecurityError`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Rest, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind, State};
use serde_json::{Map, Value as Json};

use miles_core::python::{self, JsonDumpOptions};
use miles_core::{Message, ToolSpec};

use crate::args::RenderArgs;
use crate::error::{Error, Result};
use crate::matcher::{map_eq, slice_eq};
use crate::native::Compiled;
use crate::pyfmt::{self, CivilTime};

const TEMPLATE_NAME: &str = "chat_template";
const RAISE_MARKER: &str = "\u{1}raise_exception\u{1}";
const RESERVED_KWARGS: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// The value made for the last key seen (a tokenizer renders with the same tools and kwargs
/// turn after turn), shared by clones.
struct LastMemo<K, V>(Mutex<Option<(K, V)>>);

impl<K, V: Clone> LastMemo<K, V> {
    /// The memoised value when `is_key` accepts the last key, else `make()`'s, remembered.
    fn get(&self, is_key: impl Fn(&K) -> bool, make: impl FnOnce() -> (K, V)) -> V {
        if let Ok(last) = self.0.lock()
            && let Some((key, value)) = last.as_ref()
            && is_key(key)
        {
            return value.clone();
        }
        let (key, value) = make();
        if let Ok(mut last) = self.0.lock() {
            *last = Some((key, value.clone()));
        }
        value
    }
}

impl<K, V> Default for LastMemo<K, V> {
    fn default() -> Self {
        Self(Mutex::new(None))
    }
}

/// The template variables that do not change between renders with the same kwargs: the
/// special tokens (unless a kwarg of the same name overrides them) and the kwargs.
type Variables = HashMap<String, Value>;

/// The render's root context: the per-render variables plus the memoised [`Variables`],
/// looked up without building a map per render.
#[derive(Debug)]
struct RootContext {
    variables: Arc<Variables>,
    messages: Value,
    tools: Value,
    add_generation_prompt: bool,
}

impl Object for RootContext {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.get_value_by_str(key.as_str()?)
    }

    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        match key {
            "messages" => Some(self.messages.clone()),
            "tools" => Some(self.tools.clone()),
            "documents" => Some(Value::from(())),
            "add_generation_prompt" => Some(Value::from(self.add_generation_prompt)),
            _ => self.variables.get(key).cloned(),
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let mut keys: Vec<Value> = self
            .variables
            .keys()
            .map(|k| Value::from(k.as_str()))
            .collect();
        keys.extend(RESERVED_KWARGS.iter().map(|k| Value::from(*k)));
        Enumerator::Values(keys)
    }
}

/// A compiled chat template plus the special-token variables HF passes to it.
///
/// The template is compiled once; the special tokens are converted to template values once;
/// the last `tools` list's template value is memoised (a session renders the same tools on
/// every turn), so a render converts only the messages.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source: Arc<str>,
    special_tokens: Map<String, Json>,
    special_values: Arc<[(String, Value)]>,
    /// The last `tools` list rendered and its template value.
    tools_cache: Arc<LastMemo<Vec<Json>, Value>>,
    /// The last kwargs rendered with and their [`Variables`].
    variables_cache: Arc<LastMemo<Map<String, Json>, Arc<Variables>>>,
    /// The compiled form of the template, when it is one miles-tito ships (`src/native.rs`).
    compiled: Option<Compiled>,
    /// The last `tools` list the compiled form rendered and its `"\n" ~ tool|tojson` text.
    compiled_tools: Arc<LastMemo<Vec<Json>, Arc<str>>>,
    /// Bounds on one render.
    limits: RenderLimits,
    /// The clock `strftime_now` reads.
    clock: TemplateClock,
}

/// The clock a template's `strftime_now` reads (GPT-OSS's template prints the current date).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TemplateClock {
    /// The system clock, in UTC (HF reads the machine's local clock).
    #[default]
    System,
    /// A fixed instant, in seconds after the Unix epoch: reproducible renders.
    FixedUnix(i64),
}

impl TemplateClock {
    fn now(self) -> CivilTime {
        match self {
            Self::System => CivilTime::now(),
            Self::FixedUnix(secs) => CivilTime::from_unix(secs),
        }
    }
}

/// Bounds on one render of a template through minijinja. Chat templates come with model
/// directories and are untrusted: a template that loops forever, recurses without end or
/// writes gigabytes fails with [`Error::RenderLimit`] instead.
///
/// Not bounded: memory a template builds *without writing it* (a string doubled by `~` in a
/// loop over a `namespace`); the fuel bound keeps such loops short, not their strings small.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RenderLimits {
    /// minijinja fuel: instructions one render may run (`None`: unbounded).
    pub fuel: Option<u64>,
    /// Deepest nesting of minijinja frames (a macro call costs about five; minijinja caps
    /// it at 500, which stays inside a 2 MiB thread stack).
    pub max_recursion: usize,
    /// Largest rendered text, in bytes.
    pub max_output_bytes: usize,
}

impl Default for RenderLimits {
    /// 50 million instructions (some seconds; the largest real conversations need well under
    /// a million), recursion depth 500 (about 90 nested macro calls), 64 MiB of output.
    fn default() -> Self {
        Self {
            fuel: Some(50_000_000),
            max_recursion: 500,
            max_output_bytes: 64 << 20,
        }
    }
}

impl RenderLimits {
    /// Sets [`RenderLimits::fuel`].
    pub fn with_fuel(mut self, fuel: Option<u64>) -> Self {
        self.fuel = fuel;
        self
    }
    /// Sets [`RenderLimits::max_recursion`].
    pub fn with_max_recursion(mut self, depth: usize) -> Self {
        self.max_recursion = depth;
        self
    }
    /// Sets [`RenderLimits::max_output_bytes`].
    pub fn with_max_output_bytes(mut self, bytes: usize) -> Self {
        self.max_output_bytes = bytes;
        self
    }
}

/// The render's output buffer, failing writes past its limit.
struct BoundedOutput {
    buf: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("render output limit"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("special_tokens", &self.special_tokens)
            .field("compiled", &self.compiled)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source` (the Jinja text of a chat template).
    pub fn new(source: impl Into<String>) -> Result<Self> {
        let source: String = source.into();
        let limits = RenderLimits::default();
        let clock = TemplateClock::default();
        let env = environment(&source, &limits, clock)?;
        Ok(Self {
            limits,
            clock,
            env: Arc::new(env),
            compiled: Compiled::detect(&source),
            source: source.into(),
            special_tokens: Map::new(),
            special_values: Arc::new([]),
            tools_cache: Arc::default(),
            variables_cache: Arc::default(),
            compiled_tools: Arc::default(),
        })
    }

    /// The same template under other [`RenderLimits`].
    pub fn with_render_limits(mut self, limits: RenderLimits) -> Result<Self> {
        self.env = Arc::new(environment(&self.source, &limits, self.clock)?);
        self.limits = limits;
        Ok(self)
    }

    /// The same template with `strftime_now` reading `clock`.
    pub fn with_clock(mut self, clock: TemplateClock) -> Result<Self> {
        self.env = Arc::new(environment(&self.source, &self.limits, clock)?);
        self.clock = clock;
        Ok(self)
    }

    /// The clock `strftime_now` reads.
    pub fn clock(&self) -> TemplateClock {
        self.clock
    }

    /// The bounds on one render.
    pub fn render_limits(&self) -> RenderLimits {
        self.limits
    }

    /// Whether the template renders through a compiled form (`src/native.rs`): its source
    /// is byte-identical to a template miles-tito ships.
    pub fn is_compiled(&self) -> bool {
        self.compiled.is_some()
    }

    /// The same template rendered through minijinja only, never through a compiled form (for
    /// comparing the two, or to rule the compiled form out while debugging).
    pub fn interpreted(mut self) -> Self {
        self.compiled = None;
        self
    }

    /// `"\n" ~ tool|tojson` over every tool, memoised for the last list seen.
    pub(crate) fn compiled_tools_text(&self, tools: &[Json]) -> Arc<str> {
        self.compiled_tools.get(
            |cached| slice_eq(cached, tools),
            || {
                let mut text = String::new();
                for tool in tools {
                    text.push('\n');
                    text.push_str(&python::json_dumps(tool, &JsonDumpOptions::unicode()));
                }
                (tools.to_vec(), text.into())
            },
        )
    }

    /// The template value of `tools`, memoised for the last list seen.
    fn tools_value(&self, tools: &[Json]) -> Value {
        self.tools_cache.get(
            |cached| slice_eq(cached, tools),
            || (tools.to_vec(), Value::from_serialize(tools)),
        )
    }

    /// The [`Variables`] for `kwargs`, memoised for the last kwargs seen (a tokenizer renders
    /// with the same kwargs every time).
    fn variables(&self, kwargs: &Map<String, Json>) -> Arc<Variables> {
        self.variables_cache.get(
            |cached| map_eq(cached, kwargs),
            || {
                let mut variables: Variables = self
                    .special_values
                    .iter()
                    .filter(|(k, _)| !kwargs.contains_key(k))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                for (k, v) in kwargs {
                    variables.insert(k.clone(), Value::from_serialize(v));
                }
                (kwargs.clone(), Arc::new(variables))
            },
        )
    }

    /// Sets the special-token variables (`bos_token`, `eos_token`, …) passed to every render,
    /// as HF passes `tokenizer.special_tokens_map`. Caller kwargs override them.
    pub fn with_special_tokens(mut self, special_tokens: Map<String, Json>) -> Self {
        self.special_values = special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        self.special_tokens = special_tokens;
        // The clone this came from may share the memo of the old special tokens.
        self.variables_cache = Arc::default();
        self
    }

    /// The special-token variables.
    pub fn special_tokens(&self) -> &Map<String, Json> {
        &self.special_tokens
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders like `tokenizer.apply_chat_template(messages, tools=…, add_generation_prompt=…,
    /// tokenize=False, **kwargs)`.
    pub fn render(&self, args: RenderArgs<'_>) -> Result<String> {
        if args.messages.is_empty() {
            return Err(Error::InvalidInput(
                "Cannot apply chat template to an empty conversation. Provide at least one message.".into(),
            ));
        }
        if let Some(key) = RESERVED_KWARGS
            .iter()
            .find(|k| args.kwargs.contains_key(**k))
        {
            return Err(Error::InvalidInput(format!(
                "render() got multiple values for keyword argument {key:?}"
            )));
        }
        if let Some(compiled) = self.compiled
            && let Some(text) = compiled.render(&args, &self.special_tokens, |tools| {
                self.compiled_tools_text(tools)
            })
        {
            return Ok(text);
        }
        let root = RootContext {
            variables: self.variables(args.kwargs),
            messages: messages_value(args.messages)?,
            tools: args.tools.map_or(Value::from(()), |t| self.tools_value(t)),
            add_generation_prompt: args.add_generation_prompt,
        };
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Error::TemplateSyntax {
                message: describe(&e),
            })?;
        let mut out = BoundedOutput {
            buf: Vec::new(),
            limit: self.limits.max_output_bytes,
            overflowed: false,
        };
        match template.render_captured_to(Value::from_object(root), &mut out) {
            Ok(_) => String::from_utf8(out.buf).map_err(|e| Error::Render {
                message: format!("output is not UTF-8: {e}"),
            }),
            Err(_) if out.overflowed => Err(Error::RenderLimit {
                limit: "output size",
                detail: format!("more than {} bytes", self.limits.max_output_bytes),
            }),
            Err(e) => Err(self.render_error(e)),
        }
    }

    fn render_error(&self, err: JinjaError) -> Error {
        match err.kind() {
            ErrorKind::OutOfFuel => Error::RenderLimit {
                limit: "fuel",
                detail: format!(
                    "more than {} instructions",
                    self.limits.fuel.unwrap_or(u64::MAX)
                ),
            },
            ErrorKind::InvalidOperation if err.to_string().contains("recursion limit exceeded") => {
                Error::RenderLimit {
                    limit: "recursion",
                    detail: format!("deeper than {}", self.limits.max_recursion),
                }
            }
            _ => render_error(err),
        }
    }

    /// Renders typed messages and tool specs (see [`ChatTemplate::render`]).
    pub fn render_messages(
        &self,
        messages: &[Message],
        tools: Option<&[ToolSpec]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<String> {
        let messages: Vec<Json> = messages.iter().map(Message::to_template_value).collect();
        let tools: Option<Vec<Json>> = tools.map(tools_to_json);
        self.render(RenderArgs {
            messages: &messages,
            tools: tools.as_deref(),
            add_generation_prompt,
            kwargs,
        })
    }
}

/// Tool specs as the JSON objects templates see.
pub fn tools_to_json(tools: &[ToolSpec]) -> Vec<Json> {
    tools
        .iter()
        .map(|t| serde_json::to_value(t).unwrap_or(Json::Null))
        .collect()
}

/// HF's message normalisation: every message must be an object; keys whose value is `null`
/// are dropped; a reasoning text found under `reasoning_content`, `thinking` or `reasoning`
/// is exposed as both `thinking` (first key, unless present) and `reasoning_content`.
pub fn normalise_messages(messages: &[Json]) -> Result<Vec<Json>> {
    messages
        .iter()
        .map(|message| {
            let Json::Object(map) = message else {
                return Err(Error::InvalidInput(format!(
                    "Chat messages should be dicts, dataclasses or pydantic models, but got {message}."
                )));
            };
            let map: Map<String, Json> = map
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let reasoning = REASONING_FIELDS
                .iter()
                .find_map(|key| map.get(*key).cloned());
            let Some(reasoning) = reasoning else {
                return Ok(Json::Object(map));
            };
            let mut out = Map::new();
            out.insert("thinking".into(), reasoning.clone());
            for (k, v) in map {
                out.insert(k, v);
            }
            out.insert("reasoning_content".into(), reasoning);
            Ok(Json::Object(out))
        })
        .collect()
}

/// [`normalise_messages`] straight into the template value (no intermediate JSON copy).
fn messages_value(messages: &[Json]) -> Result<Value> {
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        let Json::Object(map) = message else {
            return Err(Error::InvalidInput(format!(
                "Chat messages should be dicts, dataclasses or pydantic models, but got {message}."
            )));
        };
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|key| map.get(*key).filter(|v| !v.is_null()));
        let mut entries: Vec<(&str, Value)> = Vec::with_capacity(map.len() + 2);
        // Insertion order as in `normalise_messages`: a re-inserted key keeps its first
        // position and takes the later value.
        if let Some(reasoning) = reasoning {
            entries.push(("thinking", Value::from_serialize(reasoning)));
        }
        for (k, v) in map {
            if !v.is_null() {
                entries.push((k, Value::from_serialize(v)));
            }
        }
        if let Some(reasoning) = reasoning {
            entries.push(("reasoning_content", Value::from_serialize(reasoning)));
        }
        out.push(Value::from_iter(entries));
    }
    Ok(Value::from(out))
}

fn describe(err: &JinjaError) -> String {
    let mut text = match err.detail() {
        Some(detail) => format!("{}: {}", err.kind(), detail.replace(RAISE_MARKER, "")),
        None => err.kind().to_string(),
    };
    if let (Some(name), Some(line)) = (err.name(), err.line()) {
        let _ = write!(text, " (in {name}:{line})");
    }
    let mut source = std::error::Error::source(err);
    while let Some(inner) = source {
        let _ = write!(text, ": {inner}");
        source = inner.source();
    }
    text
}

fn find_raise(err: &JinjaError) -> Option<String> {
    if let Some(detail) = err.detail()
        && let Some(message) = detail.strip_prefix(RAISE_MARKER)
    {
        return Some(message.to_owned());
    }
    let mut source = std::error::Error::source(err);
    while let Some(inner) = source {
        if let Some(inner) = inner.downcast_ref::<JinjaError>()
            && let Some(message) = inner.detail().and_then(|d| d.strip_prefix(RAISE_MARKER))
        {
            return Some(message.to_owned());
        }
        source = inner.source();
    }
    None
}

fn render_error(err: JinjaError) -> Error {
    match find_raise(&err) {
        Some(message) => Error::TemplateRaised { message },
        None => Error::Render {
            message: describe(&err),
        },
    }
}

fn write_err(_: std::fmt::Error) -> JinjaError {
    JinjaError::new(ErrorKind::WriteFailure, "formatter write failed")
}

/// The environment of one template: HF's sandbox configuration, `limits`, `source` compiled.
fn environment(
    source: &str,
    limits: &RenderLimits,
    clock: TemplateClock,
) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    configure(&mut env);
    env.add_function("strftime_now", move |format: String| {
        pyfmt::strftime(&format, &clock.now())
    });
    env.set_fuel(limits.fuel);
    env.set_recursion_limit(limits.max_recursion);
    env.add_template_owned(TEMPLATE_NAME, source.to_owned())
        .map_err(|e| Error::TemplateSyntax {
            message: describe(&e),
        })?;
    Ok(env)
}

/// Applies HF's sandbox configuration to a minijinja environment.
fn configure(env: &mut Environment<'static>) {
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        match value.as_str() {
            Some(text) if value.kind() == ValueKind::String => out.write_str(text),
            _ => out.write_str(&pyfmt::py_str(value)),
        }
        .map_err(write_err)
    });
    env.add_filter("tojson", tojson_filter);
    env.add_filter("string", |value: Value| pyfmt::py_str(&value));
    env.add_filter("join", join_filter);
    env.add_filter("trim", |value: Value, chars: Option<String>| {
        // Jinja2: `soft_str(value).strip(chars)`, so non-strings print as Python does.
        let text = pyfmt::py_str(&value);
        match chars {
            Some(chars) => text.trim_matches(|c| chars.contains(c)).to_owned(),
            None => text.trim().to_owned(),
        }
    });
    env.add_filter("items", items_filter);
    env.add_test("sequence", |value: Value| {
        matches!(
            value.kind(),
            ValueKind::Seq | ValueKind::String | ValueKind::Map
        )
    });
    env.add_test("iterable", |value: Value| {
        matches!(
            value.kind(),
            ValueKind::Seq | ValueKind::String | ValueKind::Map | ValueKind::Iterable
        )
    });
    env.add_function(
        "raise_exception",
        |message: Value| -> Result<Value, JinjaError> {
            Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                format!("{RAISE_MARKER}{}", pyfmt::py_str(&message)),
            ))
        },
    );
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson_filter(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, JinjaError> {
    if args.is_empty() && kwargs.args().next().is_none() && !value.is_undefined() {
        return pyfmt::json_dumps(&value, &JsonDumpOptions::unicode());
    }
    let mut positional = args.iter();
    let mut options = JsonDumpOptions::unicode();
    let ensure_ascii = kwargs
        .get::<Option<Value>>("ensure_ascii")?
        .or_else(|| positional.next().cloned());
    if let Some(v) = ensure_ascii {
        options.ensure_ascii = v.is_true();
    }
    let indent = kwargs
        .get::<Option<Value>>("indent")?
        .or_else(|| positional.next().cloned());
    if let Some(v) = indent {
        options.indent = match v.kind() {
            ValueKind::None | ValueKind::Undefined => None,
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            _ => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "indent must be an int or string",
                    )
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        };
    }
    let separators = kwargs
        .get::<Option<Value>>("separators")?
        .or_else(|| positional.next().cloned());
    if let Some(v) = separators
        && !v.is_none()
        && !v.is_undefined()
    {
        let parts: Vec<Value> = v.try_iter()?.collect();
        if parts.len() != 2 {
            return Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                "separators must be a (item_separator, key_separator) pair",
            ));
        }
        options.separators = Some((pyfmt::py_str(&parts[0]), pyfmt::py_str(&parts[1])));
    }
    let sort_keys = kwargs
        .get::<Option<Value>>("sort_keys")?
        .or_else(|| positional.next().cloned());
    if let Some(v) = sort_keys {
        options.sort_keys = v.is_true();
    }
    kwargs.assert_all_used()?;
    if value.is_undefined() {
        return Err(JinjaError::new(
            ErrorKind::UndefinedError,
            "Object of type Undefined is not JSON serializable",
        ));
    }
    pyfmt::json_dumps(&value, &options)
}

/// Jinja2's `join(d="", attribute=None)`, which applies Python `str()` to the items.
fn join_filter(
    state: &State<'_, '_>,
    value: Value,
    sep: Option<String>,
    kwargs: Kwargs,
) -> Result<String, JinjaError> {
    let attribute: Option<String> = kwargs.get("attribute")?;
    kwargs.assert_all_used()?;
    let sep = sep.unwrap_or_default();
    if value.is_undefined() || value.is_none() {
        return Ok(String::new());
    }
    if let Some(s) = value.as_str() {
        // Joining a string joins its characters.
        return Ok(s.chars().map(String::from).collect::<Vec<_>>().join(&sep));
    }
    let _ = state;
    let mut out = String::new();
    for (i, item) in value.try_iter()?.enumerate() {
        if i > 0 {
            out.push_str(&sep);
        }
        let item = match &attribute {
            Some(attr) => attr.split('.').try_fold(item, |v, part| v.get_attr(part))?,
            None => item,
        };
        out.push_str(&pyfmt::py_str(&item));
    }
    Ok(out)
}

/// Jinja2's `items` filter: pairs of a mapping; undefined yields nothing; anything else is
/// the `TypeError` Jinja2 raises.
fn items_filter(value: Value) -> Result<Value, JinjaError> {
    match value.kind() {
        ValueKind::Undefined => Ok(Value::from(Vec::<Value>::new())),
        ValueKind::Map => {
            let mut pairs = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                pairs.push(Value::from(vec![key, item]));
            }
            Ok(Value::from(pairs))
        }
        _ => Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            "Can only get item pairs from a mapping.",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::{QWEN_NEXT_FIXED, QWEN3_FIXED};
    use serde_json::json;

    // The compiled renderers (`src/native.rs`) against minijinja on generated conversations.

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
            &items[self.below(items.len())]
        }
    }

    const PIECES: [&str; 12] = [
        "plain text",
        "<think>",
        "</think>",
        "\n",
        "\n\n",
        "<tool_response>",
        "</tool_response>",
        "héllo 🌍 \"quoted\"",
        "  ",
        "x",
        "<|im_end|>",
        "",
    ];

    fn text(rng: &mut Rng) -> String {
        (0..rng.below(5)).map(|_| *rng.pick(&PIECES)).collect()
    }

    /// A JSON value for an optional string field: usually a string, sometimes null, absent
    /// (`None`) or another type.
    fn maybe_text(rng: &mut Rng) -> Option<Json> {
        match rng.below(10) {
            0 => None,
            1 => Some(Json::Null),
            2 => Some(json!([{"type": "text", "text": text(rng)}])),
            3 => Some(json!(7)),
            _ => Some(Json::String(text(rng))),
        }
    }

    fn arguments(rng: &mut Rng) -> Json {
        match rng.below(6) {
            0 => Json::String("{\"city\": \"Paris\"}".into()),
            1 => json!({}),
            2 => json!({"n": 1.5, "list": [1, "a", null, true], "nested": {"é": "ü\n"}}),
            3 => json!(3),
            _ => json!({"city": text(rng)}),
        }
    }

    fn tool_call(rng: &mut Rng) -> Json {
        let function =
            json!({"name": *rng.pick(&["get_weather", "f", ""]), "arguments": arguments(rng)});
        match rng.below(8) {
            0 => function,
            1 => json!({"id": "c", "type": "function", "function": {}}),
            2 => json!({"id": "c", "type": "function", "function": {"name": 5, "arguments": {}}}),
            _ => json!({"id": "c", "type": "function", "function": function}),
        }
    }

    fn message(rng: &mut Rng) -> Json {
        let role = match rng.below(30) {
            0 => json!(3),
            1 => json!("developer"),
            _ => json!(*rng.pick(&["system", "user", "user", "assistant", "assistant", "tool"])),
        };
        let mut m = Map::new();
        m.insert("role".into(), role);
        if let Some(content) = maybe_text(rng) {
            m.insert("content".into(), content);
        }
        if m["role"] == "assistant" {
            for key in ["reasoning_content", "thinking", "reasoning"] {
                if rng.below(4) == 0
                    && let Some(value) = maybe_text(rng)
                {
                    m.insert(key.into(), value);
                }
            }
            match rng.below(6) {
                0 | 1 => {
                    let calls: Vec<Json> = (0..rng.below(3)).map(|_| tool_call(rng)).collect();
                    m.insert("tool_calls".into(), Json::Array(calls));
                }
                2 if rng.below(4) == 0 => {
                    m.insert("tool_calls".into(), json!("not a list"));
                }
                _ => {}
            }
        }
        if m["role"] == "tool" && rng.below(2) == 0 {
            m.insert("tool_call_id".into(), json!("c"));
        }
        Json::Object(m)
    }

    fn kwarg(rng: &mut Rng) -> Option<Json> {
        match rng.below(7) {
            0 => None,
            1 => Some(Json::Null),
            2 => Some(json!(0)),
            3 => Some(json!("x")),
            4 => Some(json!(true)),
            _ => Some(json!(false)),
        }
    }

    #[test]
    fn qwen3_fixed_compiled_equals_minijinja_on_generated_conversations() {
        compiled_equals_minijinja(QWEN3_FIXED, Compiled::Qwen3Fixed, 0x9e37_79b9_7f4a_7c15);
    }

    #[test]
    fn qwen_next_fixed_compiled_equals_minijinja_on_generated_conversations() {
        compiled_equals_minijinja(
            QWEN_NEXT_FIXED,
            Compiled::QwenNextFixed,
            0x2545_f491_4f6c_dd1d,
        );
    }

    fn compiled_equals_minijinja(source: &str, form: Compiled, seed: u64) {
        let compiled = ChatTemplate::new(source).unwrap();
        assert!(compiled.is_compiled());
        let interpreted = compiled.clone().interpreted();
        assert!(!interpreted.is_compiled());
        let tool_lists = [
            None,
            Some(vec![]),
            Some(vec![
                json!({"type": "function", "function": {"name": "get_weather",
                "description": "Météo «ici»", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "number", "default": 1.0}},
                "required": ["city"]}}}),
            ]),
            Some(vec![
                json!({"name": "bare"}),
                json!({"type": "function", "function": {"name": "g"}}),
            ]),
        ];
        let mut rng = Rng(seed);
        let (mut handled, mut cases) = (0, 0);
        for _ in 0..4000 {
            let len = 1 + rng.below(7);
            let messages: Vec<Json> = (0..len).map(|_| message(&mut rng)).collect();
            let tools = rng.pick(&tool_lists).clone();
            let mut kwargs = Map::new();
            for key in ["clear_thinking", "enable_thinking"] {
                if let Some(value) = kwarg(&mut rng) {
                    kwargs.insert(key.into(), value);
                }
            }
            let args = RenderArgs {
                messages: &messages,
                tools: tools.as_deref(),
                add_generation_prompt: rng.below(2) == 0,
                kwargs: &kwargs,
            };
            let fast = form.render(&args, &Map::new(), |tools| {
                compiled.compiled_tools_text(tools)
            });
            let reference = interpreted.render(args);
            cases += 1;
            if let Some(fast) = fast {
                handled += 1;
                assert_eq!(
                    Some(&fast),
                    reference.as_ref().ok(),
                    "messages {messages:?} tools {tools:?} kwargs {kwargs:?}"
                );
            }
            // Through the public entry point the result is always the template's.
            assert_eq!(
                compiled.render(args).map_err(|e| e.to_string()),
                reference.map_err(|e| e.to_string())
            );
        }
        // The generator favours the shapes sessions send: most cases take the compiled path.
        assert!(handled * 2 > cases, "compiled {handled} of {cases}");
    }

    fn render(source: &str, messages: Json, kwargs: Json) -> Result<String> {
        let template = ChatTemplate::new(source)?;
        let messages = messages.as_array().cloned().unwrap_or_default();
        let kwargs = kwargs.as_object().cloned().unwrap_or_default();
        template.render(RenderArgs {
            messages: &messages,
            tools: None,
            add_generation_prompt: false,
            kwargs: &kwargs,
        })
    }

    #[test]
    fn python_value_printing_and_tojson() {
        let out = render(
            "{{ messages[0].x }}|{{ messages[0].y }}|{{ messages[0].z|tojson }}|{{ messages[0].z|tojson(indent=1) }}",
            json!([{"role": "user", "x": true, "y": [1, "a"], "z": {"k": "é<"}}]),
            json!({}),
        )
        .unwrap();
        assert_eq!(out, "True|[1, 'a']|{\"k\": \"é<\"}|{\n \"k\": \"é<\"\n}");
    }

    #[test]
    fn null_keys_dropped_and_reasoning_aliased() {
        let out = render(
            "{% for m in messages %}{{ m|tojson }}\n{% endfor %}",
            json!([
                {"role": "user", "content": null, "name": "a"},
                {"role": "assistant", "content": "x", "reasoning": "r"}
            ]),
            json!({}),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"name\": \"a\"}\n{\"thinking\": \"r\", \"role\": \"assistant\", \"content\": \"x\", \"reasoning\": \"r\", \"reasoning_content\": \"r\"}\n"
        );
    }

    #[test]
    fn raise_exception_is_typed() {
        let err = render(
            "{{ raise_exception('nope ' ~ 1) }}",
            json!([{"role": "user"}]),
            json!({}),
        )
        .unwrap_err();
        assert!(
            matches!(err, Error::TemplateRaised { ref message } if message == "nope 1"),
            "{err}"
        );
    }

    #[test]
    fn list_append_is_rejected_like_the_sandbox() {
        let err = render(
            "{% set xs = [] %}{% set _ = xs.append(1) %}{{ xs }}",
            json!([{"role": "user"}]),
            json!({}),
        )
        .unwrap_err();
        assert!(matches!(err, Error::Render { .. }), "{err}");
    }

    #[test]
    fn kwargs_namespace_loop_and_blocks() {
        let source = "{%- set ns = namespace(n=0) %}\n{%- for m in messages %}\n  {%- if loop.first %}[{{ flag }}]{% endif %}\n  {%- set ns.n = ns.n + 1 %}\n{%- endfor %}\n{{ ns.n }} {{ 'a,b'.split(',')|length }} {{ '  x '.strip() }}{{ {'a': 1}.get('b', 2) }}\n";
        let out = render(
            source,
            json!([{"role": "user"}, {"role": "user"}]),
            json!({"flag": false}),
        )
        .unwrap();
        assert_eq!(out, "[False]2 2 x2");
        let err = render(source, json!([]), json!({})).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
        let err = render(source, json!([{"role": "user"}]), json!({"messages": 1})).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
    }
}
