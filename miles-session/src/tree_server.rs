//! The routes of tree sessions (Miles' session server v2, [`crate::tree`]) where they differ
//! from the linear server's: the chat turn (position → prepare → engine → commit under the
//! parent captured at positioning; concurrent turns of one session become siblings), the
//! session view (`GET /sessions/{id}`: the viewed path's records, `metadata.tree`), and the
//! samples op ([`crate::tree_samples::collect_tree_samples`]).

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use miles_core::TokenId;
use serde_json::{Value, json};

use crate::codec::SamplesPayload;
use crate::error::{Error, Result};
use crate::server_core::{
    AppState, BusyGuard, client_response, lookup, now_secs, path_mismatches, prepare_chat,
    read_body, respond, run_engine, template_rejection,
};
use crate::trajectory::SessionRecord;
use crate::tree::{CommitTurn, NodeId, TreeTrajectory};
use crate::tree_samples::{LeafAssembly, collect_tree_samples, session_metadata};

/// A chat turn of a tree session. Returns the response and the engine's time.
pub(crate) async fn chat_turn(
    state: &AppState,
    id: &str,
    request: Request,
) -> Result<(Response, Duration)> {
    let request_timestamp = now_secs();
    let session = lookup(state, id)?;
    let (_, bytes) = read_body(state, request).await?;
    let chat = prepare_chat(state, &bytes)?;
    let tools = chat.request.tools.clone().unwrap_or_default();
    let messages = &chat.request.messages;
    // Concurrent turns are allowed: each commits under the node it was positioned at.
    let _busy = BusyGuard::shared(&session);

    // Phase 1 (session lock): position the view, TITO-prepare the prompt ids.
    let (prompt_ids, parent) = {
        let mut tree = session.tree.lock().await;
        if session.closing.load(Ordering::Acquire) {
            return Err(Error::SessionNotFound {
                session_id: id.to_owned(),
            });
        }
        tree.has_room()?;
        if let Some(cap) = state.config.max_records_per_session
            && tree.tree().nodes().len() >= cap
        {
            return Err(Error::SessionLimit {
                reason: format!("the session already has {cap} records"),
            });
        }
        if messages.is_empty() {
            return Err(Error::validation("messages must not be empty"));
        }
        // As in Miles, the view moves before the prompt is prepared: a request refused by the
        // append check still leaves the view at its attach point (nothing is lost: the tree
        // is append-only).
        tree.position(messages, state.config.message_matcher)?;
        let ids = tree
            .prepare(messages, &tools, &chat.kwargs, state.tokenizer.as_ref())
            .map_err(template_rejection)?;
        (ids, tree.active_leaf())
    };

    // Phase 2 (no lock): the engine call.
    let prompt_len = prompt_ids.len();
    let mut turn = run_engine(state, id, &chat, &prompt_ids, &tools).await?;

    // Phase 3 (session lock): append under the captured parent.
    {
        let mut tree = session.tree.lock().await;
        if session.closing.load(Ordering::Acquire) {
            state.metrics.turns_skipped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                session = id,
                "session closing during the engine call; turn not recorded"
            );
            return Err(Error::SessionNotFound {
                session_id: id.to_owned(),
            });
        }
        let response_id = turn.body["id"].as_str().unwrap_or_default().to_owned();
        let finish_reason = turn.body["choices"][0]["finish_reason"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let record = SessionRecord {
            timestamp: now_secs(),
            request_timestamp: Some(request_timestamp),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            request: chat.record_body.clone(),
            input_ids: Some(prompt_ids.clone()),
            response: std::mem::take(&mut turn.body),
            status_code: 200,
        };
        let committed = tree.commit(
            parent,
            CommitTurn {
                request: messages,
                assistant: turn.assistant.clone(),
                prompt_ids: &prompt_ids,
                completion_ids: &turn.output.output_ids,
                max_trim_tokens: state.tokenizer.max_trim_tokens(),
                record,
                response_id,
                finish_reason,
            },
        );
        if let Err(e) = committed {
            state.metrics.turns_skipped.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        state.metrics.turns.fetch_add(1, Ordering::Relaxed);
    }
    let response = client_response(state, chat.stream, prompt_len, &turn)?;
    Ok((response, turn.engine_time))
}

/// The mismatch of the path root → `node` (as JSON), without counting it in the metrics.
fn node_mismatch(
    state: &AppState,
    tree: &TreeTrajectory,
    node: NodeId,
    count: bool,
) -> Option<Value> {
    let n = tree.tree().node(node)?;
    let messages = tree.tree().path_messages(node);
    let token_ids: &[TokenId] = &n.token_ids;
    path_mismatches(state, &messages, &n.record.request, token_ids, count).map(|m| json!(m))
}

/// The session's metadata: the viewed path's mismatch (counted in the metrics),
/// `accumulated_token_ids`, `max_trim_tokens`, `tree`.
fn metadata(state: &AppState, tree: &TreeTrajectory) -> serde_json::Map<String, Value> {
    let mismatch = tree
        .active_leaf()
        .and_then(|leaf| node_mismatch(state, tree, leaf, true));
    session_metadata(tree, state.tokenizer.max_trim_tokens(), mismatch)
}

/// `GET /sessions/{id}` of a tree session: the viewed path's records and the metadata.
pub(crate) async fn get_session(state: &AppState, id: &str) -> Response {
    let result = async {
        let session = lookup(state, id)?;
        let tree = session.tree.lock().await;
        let body = json!({
            "session_id": id,
            "records": tree.active_records(),
            "metadata": metadata(state, &tree),
        });
        Ok(axum::Json(body).into_response())
    }
    .await;
    respond(state, result)
}

/// The samples op of a tree session (under its lock, so it cannot interleave with commits).
pub(crate) fn assemble(
    state: &AppState,
    tree: &TreeTrajectory,
    max_seq_len: Option<usize>,
    agent_metadata: Option<Value>,
) -> Result<SamplesPayload> {
    let tok = state.tokenizer.as_ref();
    let decode = |ids: &[TokenId]| tok.decode_text(ids, true);
    let mismatch = |leaf: NodeId| node_mismatch(state, tree, leaf, false);
    let assembly = LeafAssembly {
        max_seq_len,
        max_trim_tokens: tok.max_trim_tokens(),
        decode: &decode,
        mismatch: &mismatch,
        save_debug_trajectory_data: state.config.save_debug_trajectory_data,
    };
    collect_tree_samples(
        tree.tree(),
        metadata(state, tree),
        agent_metadata,
        &assembly,
        &state.config.sample_hooks,
    )
}
