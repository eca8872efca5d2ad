//! GPT-OSS's harmony output (SGLang `--reasoning-parser gpt-oss`, `--tool-call-parser
//! gpt-oss`): the analysis, commentary and final channels.
//!
//! A model turn is a run of messages `<|start|>assistant<|channel|>CHANNEL HEADER<|message|>
//! BODY END` (the first one's `<|start|>assistant` is the generation prompt's): `analysis` is
//! the reasoning and ends with `<|end|>`; `commentary` ends with `<|end|>` (a preamble the user
//! sees) or with `<|call|>` (a tool call, its recipient `to=functions.NAME` and its
//! `<|constrain|>json` in the header); `final` is the answer and ends with `<|return|>` (or the
//! end of the text when generation was cut short).
//!
//! The block rules are SGLang's `HarmonyParser` in one-shot use (its canonical strategy, the
//! text parsed once and its held-back rest flushed once): the same events in the same order,
//! the same treatment of unknown `<|…|>` markers, of a `commentary` filler after `<|call|>`,
//! and of an unterminated analysis block (reasoning up to the end). Its text fallback for
//! output decoded without special tokens (`analysis…assistantfinal…`) is not reproduced: the
//! session decodes with special tokens, and a text without `<|channel|>` or `<|start|>` gives
//! no events at all, as SGLang's canonical path does for it.

use super::markup::{RawCall, python_json};

/// The structural markers (SGLang's `iter_tokens` table, in its order).
const MARKERS: [(&str, Kind); 7] = [
    ("<|start|>", Kind::Start),
    ("<|channel|>", Kind::Channel),
    ("<|message|>", Kind::Message),
    ("<|constrain|>", Kind::Constrain),
    ("<|end|>", Kind::End),
    ("<|call|>", Kind::Call),
    ("<|return|>", Kind::Return),
];

/// The markers that end a turn (the engine's stop tokens), which the block rules read.
pub(crate) const END_MARKERS: [&str; 2] = ["<|return|>", "<|call|>"];

/// What a tool call's text must hold for the tool-call parser to read it.
pub(crate) const TOOL_CALL_START: &str = "<|start|>assistant<|channel|>commentary";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Start,
    Channel,
    Message,
    Constrain,
    End,
    Call,
    Return,
}

#[derive(Debug, Clone, Copy)]
struct Token {
    kind: Kind,
    start: usize,
    end: usize,
}

/// One parsed piece of a turn.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    /// Analysis-channel text.
    Reasoning(String),
    /// Text the user sees (final channel, commentary preambles, stray text).
    Normal(String),
    /// A block ended by `<|call|>`: its stripped body and its raw text, markers included.
    ToolCall { raw: String },
}

/// Splits `text` at the structural markers (SGLang's `iter_tokens`).
fn tokens(text: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut push = |kind, start, end| out.push(Token { kind, start, end });
    let mut pos = 0;
    let mut unknown = false;
    while pos < text.len() {
        let Some(found) = text[pos..].find("<|") else {
            break;
        };
        let at = pos + found;
        if at > pos {
            push(Kind::Text, pos, at);
        }
        if let Some((literal, kind)) = MARKERS.iter().find(|(l, _)| text[at..].starts_with(l)) {
            push(*kind, at, at + literal.len());
            pos = at + literal.len();
            continue;
        }
        let tail = &text[at..];
        if MARKERS.iter().any(|(l, _)| l.starts_with(tail)) {
            // A marker cut off by the end of the text.
            push(Kind::Text, at, text.len());
            pos = text.len();
            break;
        }
        // An unknown `<|…` marker: its `<|` is text, then the text up to the next marker.
        unknown = true;
        push(Kind::Text, at, at + 2);
        match text[at + 2..].find("|>") {
            Some(close) => {
                let after_close = at + 2 + close + 2;
                match text[after_close..].find("<|") {
                    Some(next) => {
                        push(Kind::Text, at + 2, after_close + next);
                        pos = after_close + next;
                    }
                    None => {
                        push(Kind::Text, at + 2, text.len());
                        pos = text.len();
                        break;
                    }
                }
            }
            None => pos = at + 2,
        }
    }
    if pos < text.len() {
        push(Kind::Text, pos, text.len());
    } else if unknown && MARKERS.iter().any(|(l, _)| text.ends_with(l)) {
        push(Kind::Text, pos, pos);
    }
    out
}

/// `(emit now, hold back)`: the longest suffix of `text` that could begin a marker is held.
fn prefix_hold(text: &str) -> (&str, &str) {
    let mut hold = 0;
    for (literal, _) in MARKERS {
        let longest = (literal.len() - 1).min(text.len());
        if let Some(k) = (1..=longest).rev().find(|&k| {
            text.is_char_boundary(text.len() - k) && literal.starts_with(&text[text.len() - k..])
        }) {
            hold = hold.max(k);
        }
    }
    text.split_at(text.len() - hold)
}

/// The channel named at the start of a header (`analysis`, `commentary`, `final`).
fn channel_of(header: &str) -> Option<&'static str> {
    let header = header.trim().to_lowercase();
    ["analysis", "commentary", "final"]
        .into_iter()
        .find(|c| header.starts_with(c))
}

/// The first `<|channel|>` and the first `<|message|>` from `from` (the scan stops at the
/// message).
fn channel_and_message(tokens: &[Token], from: usize) -> (Option<usize>, Option<usize>) {
    let mut channel = None;
    for (i, token) in tokens.iter().enumerate().skip(from) {
        match token.kind {
            Kind::Channel if channel.is_none() => channel = Some(i),
            Kind::Message => return (channel, Some(i)),
            _ => {}
        }
    }
    (channel, None)
}

/// One block from a `<|start|>` or `<|channel|>` token: `(event, next token)`, or `None` when
/// the block is incomplete.
fn block(text: &str, tokens: &[Token], start: usize) -> Option<(Option<Event>, usize)> {
    let from = start + usize::from(tokens[start].kind == Kind::Start);
    let (channel, message) = channel_and_message(tokens, from);
    let message = message?;
    let content_start = tokens[message].end;
    let Some(channel) = channel else {
        // No channel: a tool's answer, ended by any end marker.
        let end = (message + 1..tokens.len())
            .find(|&i| matches!(tokens[i].kind, Kind::End | Kind::Call | Kind::Return))?;
        let body = &text[content_start..tokens[end].start];
        return Some((Some(Event::Normal(body.to_owned())), end + 1));
    };
    let header_start = tokens
        .get(channel + 1)
        .map_or(tokens[channel].end, |t| t.start);
    let kind = channel_of(&text[header_start..tokens[message].start])?;
    let ends: &[Kind] = if kind == "final" {
        &[Kind::Return]
    } else {
        &[Kind::End, Kind::Call]
    };
    let Some(end) = (message + 1..tokens.len()).find(|&i| ends.contains(&tokens[i].kind)) else {
        // Only a final block may run to the end of the text.
        return (kind == "final").then(|| {
            (
                Some(Event::Normal(text[content_start..].to_owned())),
                tokens.len(),
            )
        });
    };
    let end_token = tokens[end];
    let body = &text[content_start..end_token.start];
    let raw = || text[tokens[start].start..end_token.end].to_owned();
    Some(match (kind, end_token.kind) {
        // Built-in tools (browser, python) are called from the analysis channel.
        ("analysis" | "commentary", Kind::Call) => (Some(Event::ToolCall { raw: raw() }), end + 1),
        ("analysis", _) => (Some(Event::Reasoning(body.to_owned())), end + 1),
        ("commentary", _) => (Some(Event::Normal(body.to_owned())), end + 1),
        _ => match tokens.get(end + 1) {
            // Text right after `<|return|>` belongs to the final answer.
            Some(next) if next.kind == Kind::Text => (
                Some(Event::Normal(format!(
                    "{body}{}",
                    &text[next.start..next.end]
                ))),
                end + 2,
            ),
            _ => (Some(Event::Normal(body.to_owned())), end + 1),
        },
    })
}

/// An unterminated analysis block from `start`: its text so far as reasoning, and the text to
/// keep for the next pass (the block's header).
fn partial_analysis(text: &str, tokens: &[Token], start: usize) -> Option<(Event, usize)> {
    let from = start + usize::from(tokens[start].kind == Kind::Start);
    let (channel, message) = channel_and_message(tokens, from);
    let (channel, message) = (channel?, message?);
    let header_start = tokens
        .get(channel + 1)
        .map_or(tokens[channel].end, |t| t.start);
    if channel_of(&text[header_start..tokens[message].start]) != Some("analysis") {
        return None;
    }
    let content_start = tokens[message].end;
    Some((
        Event::Reasoning(text[content_start..].to_owned()),
        content_start,
    ))
}

/// Text between blocks that SGLang drops: a `commentary` word or a `<|message|>` right after
/// `<|call|>`.
fn is_filler(text: &str, tokens: &[Token], pos: usize) -> bool {
    if pos == 0 || tokens[pos - 1].kind != Kind::Call {
        return false;
    }
    let current = tokens[pos];
    let word = text[current.start..current.end].trim().to_lowercase();
    current.kind == Kind::Message || (current.kind == Kind::Text && word == "commentary")
}

/// Whether `content` is a bare structural marker (dropped where it stands alone).
fn is_bare_marker(content: &str) -> bool {
    let content = content.trim();
    MARKERS.iter().any(|(l, _)| *l == content)
}

/// One pass of the canonical strategy: the events and the text held back for the next pass.
fn pass(text: &str) -> (Vec<Event>, &str) {
    let tokens = tokens(text);
    let mut events = Vec::new();
    let mut pos = 0;
    while pos < tokens.len() {
        let token = tokens[pos];
        match token.kind {
            Kind::Text if pos + 1 == tokens.len() => {
                let (emit, hold) = prefix_hold(&text[token.start..token.end]);
                if !emit.is_empty() {
                    events.push(Event::Normal(emit.to_owned()));
                }
                return (events, hold);
            }
            Kind::Start | Kind::Channel => match block(text, &tokens, pos) {
                Some((event, next)) => {
                    events.extend(event);
                    pos = next;
                }
                None => {
                    if let Some((event, keep_from)) = partial_analysis(text, &tokens, pos) {
                        events.push(event);
                        return (events, &text[token.start..keep_from]);
                    }
                    return (events, &text[token.start..]);
                }
            },
            _ => {
                let content = &text[token.start..token.end];
                if !is_filler(text, &tokens, pos) && !is_bare_marker(content) {
                    events.push(Event::Normal(content.to_owned()));
                }
                pos += 1;
            }
        }
    }
    (events, "")
}

/// The events of a whole output: SGLang's `HarmonyParser.parse(text)` then `parse("")`, with
/// its filter of `commentary` filler after a tool call.
fn events(text: &str) -> Vec<Event> {
    if !text.contains("<|channel|>") && !text.contains("<|start|>") {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut filter_commentary = false;
    let mut partial = String::new();
    let mut buffer = text.to_owned();
    for _ in 0..2 {
        let (events, held) = pass(&buffer);
        let ends_with_call = buffer.trim_end().ends_with("<|call|>");
        for event in events {
            if let Event::Normal(content) = &event {
                if filter_commentary || !partial.is_empty() {
                    let candidate = format!("{partial}{}", content.trim().to_lowercase());
                    if candidate == "commentary" {
                        partial.clear();
                        filter_commentary = false;
                        continue;
                    }
                    if "commentary".starts_with(&candidate) {
                        partial = candidate;
                        continue;
                    }
                    filter_commentary = false;
                }
                partial.clear();
            }
            if matches!(event, Event::ToolCall { .. }) {
                filter_commentary = true;
                partial.clear();
            } else if ends_with_call {
                filter_commentary = true;
            }
            out.push(event);
        }
        buffer = held.to_owned();
    }
    out
}

/// SGLang's `GptOssDetector` (reasoning): `(analysis text, the rest)`, the rest being the
/// final and commentary text with each tool-call block kept raw for the tool-call parser.
/// `None` when there is no analysis text.
pub(crate) fn split_reasoning(text: &str) -> (Option<String>, String) {
    let mut reasoning = String::new();
    let mut normal = String::new();
    for event in events(text) {
        match event {
            Event::Reasoning(r) => reasoning.push_str(&r),
            Event::Normal(n) => normal.push_str(&n),
            Event::ToolCall { raw } => normal.push_str(&raw),
        }
    }
    ((!reasoning.is_empty()).then_some(reasoning), normal)
}

/// SGLang's `GptOssDetector` (tool calls) on a text holding [`TOOL_CALL_START`]: the normal
/// pieces joined by spaces and stripped, and each call whose header reads
/// `to=NAMESPACE.NAME <|constrain|>json<|message|>ARGS` with JSON (or empty) arguments.
/// Analysis text is ignored.
pub(crate) fn tool_calls(text: &str) -> (String, Vec<RawCall>) {
    let mut normal = Vec::new();
    let mut calls = Vec::new();
    for event in events(text) {
        match event {
            Event::ToolCall { raw } => calls.extend(call_of(&raw)),
            Event::Normal(n) => normal.push(n),
            Event::Reasoning(_) => {}
        }
    }
    (normal.join(" ").trim().to_owned(), calls)
}

/// The first `to=NAME\s*<|constrain|>json<|message|>(ARGS)(<|call|>|$)` of a call block
/// (SGLang's pattern, searched left to right), its arguments parsed.
fn call_of(raw: &str) -> Option<RawCall> {
    const JSON_BODY: &str = "<|constrain|>json<|message|>";
    let mut from = 0;
    while let Some(found) = raw[from..].find("to=") {
        let name_start = from + found + 3;
        from = name_start;
        let name_len = raw[name_start..]
            .char_indices()
            .take_while(|&(i, c)| {
                if i == 0 {
                    c.is_ascii_alphabetic() || c == '_'
                } else {
                    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
                }
            })
            .count();
        if name_len == 0 {
            continue;
        }
        let name = &raw[name_start..name_start + name_len];
        let Some(after) = raw[name_start + name_len..]
            .trim_start()
            .strip_prefix(JSON_BODY)
        else {
            continue;
        };
        // `(.*?)(?:<\|call\|>|$)`: up to the first `<|call|>`, or the end (before a final
        // newline).
        let end = after.strip_suffix('\n').map_or(after.len(), str::len);
        let args = &after[..after.find("<|call|>").map_or(end, |c| c.min(end))];
        let name = name.rsplit('.').next().unwrap_or(name);
        let arguments = if args.trim().is_empty() {
            serde_json::Value::Object(serde_json::Map::new())
        } else {
            // A call whose arguments are not JSON is dropped.
            serde_json::from_str(args).ok()?
        };
        return Some((None, name.to_owned(), python_json(&arguments)));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_split_like_sglang() {
        // iter_tokens("a<|end|>b<|x|>c<|ret"): TEXT, END, TEXT, TEXT("<|"), TEXT("x|>c"),
        // TEXT("<|ret") (a cut-off marker).
        let text = "a<|end|>b<|x|>c<|ret";
        let kinds: Vec<(Kind, &str)> = tokens(text)
            .into_iter()
            .map(|t| (t.kind, &text[t.start..t.end]))
            .collect();
        assert_eq!(
            kinds,
            [
                (Kind::Text, "a"),
                (Kind::End, "<|end|>"),
                (Kind::Text, "b"),
                (Kind::Text, "<|"),
                (Kind::Text, "x|>c"),
                (Kind::Text, "<|ret"),
            ]
        );
        assert_eq!(prefix_hold("abc<|st"), ("abc", "<|st"));
        assert_eq!(prefix_hold("北京"), ("北京", ""));
    }

    #[test]
    fn every_cut_and_marker_soup_parses_without_panicking() {
        let output = "<|channel|>analysis<|message|>天气 <|x|> ok<|end|><|start|>assistant\
                      <|channel|>commentary to=functions.get_weather <|constrain|>json\
                      <|message|>{\"city\": \"北京\"}<|call|>commentary<|message|>\
                      <|start|>assistant<|channel|>final<|message|>done<|return|>tail";
        for (cut, _) in output.char_indices().chain([(output.len(), ' ')]) {
            let (_, normal) = split_reasoning(&output[..cut]);
            let _ = tool_calls(&normal);
            let _ = tool_calls(&output[..cut]);
        }
        let pieces = [
            "<|",
            "|>",
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|call|>",
            "to=",
            "é",
            "\n",
        ];
        let mut state = 7u64;
        for _ in 0..2000 {
            let mut text = String::new();
            for _ in 0..12 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                text.push_str(pieces[(state >> 33) as usize % pieces.len()]);
            }
            let (_, normal) = split_reasoning(&text);
            let _ = tool_calls(&normal);
        }
    }
}
