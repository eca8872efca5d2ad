//! The DeepSeek V4 encoder (sglang's `encoding_dsv4`): adjacent tool results and user turns
//! merged, tool results sorted by call order, tasks, reminders and reasoning effort.

use std::borrow::Cow;

use serde_json::{Map, Value as Json, json};

use super::common::*;
use super::pydict::*;
use super::tokens::*;
use super::version::DeepSeekVersion;
use miles_core::python::{repr, str as py_str};

/// Tool messages become `tool_result` blocks of a user message; a user message (or tool
/// result) directly after such a merged user message joins it.
pub(super) fn merge_tool_messages(messages: &[Json]) -> Py<Vec<Json>> {
    static EMPTY: Json = Json::String(String::new());
    let mut merged: Vec<Json> = Vec::with_capacity(messages.len());
    for message in messages {
        let role = role_of(message)?;
        let joinable = |merged: &[Json], need_no_task: bool| -> Py<bool> {
            let Some(last) = merged.last() else {
                return Ok(false);
            };
            Ok(is_str(role_of(last)?, "user")
                && as_dict(last)?.contains_key("content_blocks")
                && (!need_no_task || get(last, "task")?.is_null()))
        };
        if is_str(role, "tool") {
            let block = json!({
                "type": "tool_result",
                "tool_use_id": get_or(message, "tool_call_id", &EMPTY)?,
                "content": get_or(message, "content", &EMPTY)?,
            });
            if joinable(&merged, false)? {
                push_block(merged.last_mut(), block)?;
            } else {
                merged.push(json!({"role": "user", "content_blocks": [block]}));
            }
        } else if is_str(role, "user") {
            let content = get_or(message, "content", &EMPTY)?;
            let block = json!({"type": "text", "text": content});
            if joinable(&merged, true)? {
                push_block(merged.last_mut(), block)?;
            } else {
                let mut new = Map::new();
                new.insert("role".into(), json!("user"));
                new.insert("content".into(), content.clone());
                new.insert("content_blocks".into(), json!([block]));
                let source = as_dict(message)?;
                for key in ["task", "wo_eos", "mask"] {
                    if let Some(value) = source.get(key) {
                        new.insert(key.into(), value.clone());
                    }
                }
                merged.push(Json::Object(new));
            }
        } else {
            merged.push(message.clone());
        }
    }
    Ok(merged)
}

pub(super) fn push_block(target: Option<&mut Json>, block: Json) -> Py<()> {
    match target.and_then(|m| m.get_mut("content_blocks")) {
        Some(Json::Array(blocks)) => {
            blocks.push(block);
            Ok(())
        }
        Some(other) => raise(
            "AttributeError",
            format!("'{}' object has no attribute 'append'", py_type(other)),
        ),
        None => raise("KeyError", "'content_blocks'"),
    }
}

/// Within each user message, tool results follow the order of the preceding assistant's
/// tool calls (by id; unknown ids sort first).
pub(super) fn sort_tool_results(messages: &mut [Json]) -> Py<()> {
    static EMPTY_STR: Json = Json::String(String::new());
    let empty_obj = Json::Object(Map::new());
    let mut order: Vec<(Json, usize)> = Vec::new();
    for message in messages.iter_mut() {
        let role = role_of(message)?.clone();
        if is_str(&role, "assistant") && truthy(get(message, "tool_calls")?) {
            order.clear();
            for (idx, call) in iterate(get(message, "tool_calls")?)?.iter().enumerate() {
                let id = get(call, "id")?;
                let id = if truthy(id) {
                    id
                } else {
                    get_or(get_or(call, "function", &empty_obj)?, "id", &EMPTY_STR)?
                };
                if truthy(id) {
                    hashable(id)?;
                    match order.iter_mut().find(|(k, _)| k == id) {
                        Some(entry) => entry.1 = idx,
                        None => order.push((id.clone(), idx)),
                    }
                }
            }
        } else if is_str(&role, "user") && truthy(get(message, "content_blocks")?) {
            let blocks: Vec<Json> = iterate(get(message, "content_blocks")?)?
                .into_iter()
                .map(Cow::into_owned)
                .collect();
            let mut tool_blocks = Vec::new();
            for block in &blocks {
                if is_str(get(block, "type")?, "tool_result") {
                    tool_blocks.push(block.clone());
                }
            }
            if tool_blocks.len() > 1 && !order.is_empty() {
                let mut keyed = Vec::with_capacity(tool_blocks.len());
                for block in tool_blocks {
                    let id = get_or(&block, "tool_use_id", &EMPTY_STR)?;
                    hashable(id)?;
                    let key = order.iter().find(|(k, _)| k == id).map_or(0, |(_, v)| *v);
                    keyed.push((key, block));
                }
                keyed.sort_by_key(|(key, _)| *key);
                let mut sorted = keyed.into_iter().map(|(_, b)| b);
                let mut new_blocks = Vec::with_capacity(blocks.len());
                for block in blocks {
                    if is_str(get(&block, "type")?, "tool_result") {
                        new_blocks.extend(sorted.next());
                    } else {
                        new_blocks.push(block);
                    }
                }
                if let Json::Object(map) = message {
                    map.insert("content_blocks".into(), Json::Array(new_blocks));
                }
            }
        }
    }
    Ok(())
}

pub(super) fn encode_v4(messages: &[Json], options: &DeepSeekEncodeOptions) -> Py<String> {
    let merged = merge_tool_messages(messages)?;
    let raw_context = options.context()?;
    let n_context = raw_context.len();
    let mut combined: Vec<Json> = raw_context.iter().cloned().chain(merged).collect();
    sort_tool_results(&mut combined)?;
    let messages = combined.split_off(n_context);
    let context = if n_context > 0 {
        let mut context = merge_tool_messages(&combined)?;
        sort_tool_results(&mut context)?;
        context
    } else {
        Vec::new()
    };
    let mut full: Vec<Json> = context.iter().chain(&messages).cloned().collect();
    let mut prompt = String::new();
    if options.add_default_bos_token && context.is_empty() {
        prompt.push_str(BOS);
    }
    let mut any_tools = false;
    for message in &full {
        any_tools |= truthy(get(message, "tools")?);
    }
    let drop = options.drop_thinking && !any_tools;
    let (count, context_len) = if options.thinking() && drop {
        full = drop_thinking(&full, &KEEP_V4)?;
        let count = full.len() as isize - drop_thinking(&context, &KEEP_V4)?.len() as isize;
        (count, full.len() as isize - count)
    } else {
        (messages.len() as isize, context.len() as isize)
    };
    let effective = DeepSeekEncodeOptions {
        drop_thinking: drop,
        ..options.clone()
    };
    for idx in 0..count.max(0) {
        render_v4((idx + context_len) as usize, &full, &effective, &mut prompt)?;
    }
    Ok(prompt)
}

pub(super) fn render_v4(
    index: usize,
    messages: &[Json],
    options: &DeepSeekEncodeOptions,
    prompt: &mut String,
) -> Py<()> {
    if index >= messages.len() {
        return raise("AssertionError", "");
    }
    if !options.mode_is_valid() {
        return raise(
            "AssertionError",
            format!("Invalid thinking_mode `{}`", py_str(&options.thinking_mode)),
        );
    }
    static FALSE: Json = Json::Bool(false);
    static EMPTY: Json = Json::String(String::new());
    let message = &messages[index];
    let last_user = find_last_user_index(messages)?;
    let f = fields(message)?;
    let wo_eos = get_or(message, "wo_eos", &FALSE)?;
    let effort = &options.reasoning_effort;
    if !(effort.is_null() || is_str(effort, "max") || is_str(effort, "high")) {
        return raise(
            "AssertionError",
            format!("Invalid reasoning effort: {}", py_str(effort)),
        );
    }
    let idx = index as isize;
    let thinking = options.thinking();
    if index == 0 && thinking && is_str(effort, "max") {
        prompt.push_str(REASONING_EFFORT_MAX);
    }
    match f.role.as_str() {
        Some("system") => prompt.push_str(&system_text(DeepSeekVersion::V4, &f)),
        Some("developer") => {
            if !truthy(f.content) {
                return raise(
                    "AssertionError",
                    format!("Invalid message for role `developer`: {}", repr(message)),
                );
            }
            prompt.push_str(USER_TOKEN);
            prompt.push_str(concat_operand(f.content)?);
            if let Some(tools) = &f.tools {
                prompt.push_str("\n\n");
                prompt.push_str(&render_tools(DeepSeekVersion::V4, tools));
            }
            if truthy(f.response_format) {
                prompt.push_str(&response_format_text(f.response_format));
            }
        }
        Some("user") => {
            prompt.push_str(USER_TOKEN);
            let blocks = get(message, "content_blocks")?;
            if truthy(blocks) {
                let mut parts: Vec<Cow<'_, Json>> = Vec::new();
                for block in iterate(blocks)? {
                    let kind = get(&block, "type")?;
                    if is_str(kind, "text") {
                        parts.push(Cow::Owned(get_or(&block, "text", &EMPTY)?.clone()));
                    } else if is_str(kind, "tool_result") {
                        let content = get_or(&block, "content", &EMPTY)?;
                        let text = match content {
                            Json::Array(items) => {
                                let mut texts: Vec<Cow<'_, Json>> = Vec::new();
                                for item in items {
                                    let item_kind = get(item, "type")?;
                                    if is_str(item_kind, "text") {
                                        texts.push(Cow::Borrowed(get_or(item, "text", &EMPTY)?));
                                    } else {
                                        texts.push(Cow::Owned(Json::String(format!(
                                            "[Unsupported {}]",
                                            py_str(item_kind)
                                        ))));
                                    }
                                }
                                join_strings(&texts, "\n\n")?
                            }
                            other => py_str(other).into_owned(),
                        };
                        parts.push(Cow::Owned(Json::String(format!(
                            "<tool_result>{text}</tool_result>"
                        ))));
                    } else {
                        parts.push(Cow::Owned(Json::String(format!(
                            "[Unsupported {}]",
                            py_str(kind)
                        ))));
                    }
                }
                prompt.push_str(&join_strings(&parts, "\n\n")?);
            } else if truthy(f.content) {
                prompt.push_str(concat_operand(f.content)?);
            }
        }
        Some("latest_reminder") => {
            prompt.push_str(LATEST_REMINDER_TOKEN);
            prompt.push_str(&py_str(f.content));
        }
        Some("tool") => {
            return raise(
                "NotImplementedError",
                "deepseek_v4 merges tool messages into user; please preprocess with merge_tool_messages()",
            );
        }
        Some("assistant") => {
            let calls_text = match &f.tool_calls {
                Some(calls) => tool_calls_block(calls, "tool_calls")?,
                None => String::new(),
            };
            let prev_has_task = index >= 1 && !get(&messages[index - 1], "task")?.is_null();
            if thinking && !prev_has_task && (!options.drop_thinking || idx > last_user) {
                prompt.push_str(&or_empty(f.reasoning_content));
                prompt.push_str(THINK_END);
            }
            prompt.push_str(&or_empty(f.content));
            prompt.push_str(&calls_text);
            if !truthy(wo_eos) {
                prompt.push_str(EOS);
            }
        }
        _ => {
            return raise(
                "NotImplementedError",
                format!("Unknown role: {}", py_str(f.role)),
            );
        }
    }

    // What follows this message decides the transition tokens.
    if index + 1 < messages.len() {
        let next = role_of(&messages[index + 1])?;
        if !(is_str(next, "assistant") || is_str(next, "latest_reminder")) {
            return Ok(());
        }
    }
    let task = get(message, "task")?;
    if !task.is_null() {
        hashable(task)?;
        let Some(token) = V4_TASKS
            .iter()
            .find(|(name, _)| is_str(task, name))
            .map(|(_, token)| *token)
        else {
            return raise(
                "AssertionError",
                format!(
                    "Invalid task: '{}'. Valid tasks are: {:?}",
                    py_str(task),
                    V4_TASKS.map(|(name, _)| name)
                ),
            );
        };
        if is_str(task, "action") {
            prompt.push_str(ASSISTANT_TOKEN);
            prompt.push_str(if thinking { THINK_START } else { THINK_END });
        }
        prompt.push_str(token);
    } else if is_str(f.role, "user") || is_str(f.role, "developer") {
        prompt.push_str(ASSISTANT_TOKEN);
        prompt.push_str(options.opener(idx >= last_user));
    }
    Ok(())
}
