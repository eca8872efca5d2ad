//! The samples op of tree sessions (Miles' session server v2): one raw sample per leaf, then
//! the pick and post-process hooks, then Miles' v2 samples wire.
//!
//! * [`tree_metadata`]: the structural tables (`nodes`, `leaves`) a session's metadata
//!   carries under `tree` (Miles' `tree_metadata`).
//! * [`build_leaf_material`]: each leaf's root→leaf records assembled, truncated and merged
//!   into one sample, in commit order, with `metadata.leaf` and the flat bookkeeping keys
//!   (Miles' `build_leaf_material`).
//! * [`SamplePicker`] (Miles' `--session-sample-picker-path`): a pure selection over those
//!   samples; [`DropRetries`] is Miles' default (temporal-supersession retry trim),
//!   [`KeepAllLeaves`] keeps every leaf (tree RL).
//! * [`SamplePostprocessor`] (Miles' `--session-sample-postprocessor-path`): finalizes the
//!   kept samples; [`DefaultPostprocess`] is Miles' default (a completion shared by several
//!   kept leaves is trained once, by the earliest; the agent's metadata and reward applied).
//! * [`collect_tree_samples`]: the whole op, as `POST /sessions/{id}/samples` runs it.
//!
//! Hooks run synchronously on the request; a failing hook (or a picker returning an index
//! twice or out of range) is a 422 naming both hooks ([`Error::SampleHook`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use miles_core::{Reward, Sample};
use serde_json::{Map, Value, json};

use crate::assembly::{
    Decode, RecordTurn, compute_samples_from_turns, merge_samples, truncate_samples_by_total_tokens,
};
use crate::codec::{EmptyReason, SamplesPayload};
use crate::error::{Error, Result};
use crate::tree::{NodeId, SessionTree, TreeTrajectory};

/// Sample metadata keys the server owns: an agent's metadata cannot replace them (Miles'
/// `_SERVER_OWNED_METADATA_KEYS`).
pub const SERVER_OWNED_METADATA_KEYS: [&str; 3] =
    ["accumulated_token_ids", "tito_session_mismatch", "leaf"];

/// Miles' `tree_metadata`: `{"nodes": [{"id", "parent", "seq", "truncated", "committed_at",
/// "completion_span", "num_tokens", "response_id"}, …], "leaves": [{"node_id",
/// "path_node_ids"}, …]}`, both in commit order.
pub fn tree_metadata(tree: &SessionTree) -> Value {
    let nodes: Vec<Value> = tree
        .nodes()
        .iter()
        .map(|n| {
            json!({
                "id": n.seq,
                "parent": n.parent,
                "seq": n.seq,
                "truncated": n.truncated(),
                "committed_at": n.committed_at,
                "completion_span": [n.completion_span.0, n.completion_span.1],
                "num_tokens": n.token_ids.len(),
                "response_id": n.response_id,
            })
        })
        .collect();
    let leaves: Vec<Value> = tree
        .leaves()
        .into_iter()
        .map(|leaf| json!({"node_id": leaf, "path_node_ids": tree.path(leaf)}))
        .collect();
    json!({"nodes": nodes, "leaves": leaves})
}

/// What [`build_leaf_material`] needs besides the tree.
pub struct LeafAssembly<'a> {
    /// Truncation budget (prompt + completion tokens), applied per turn before the merge.
    pub max_seq_len: Option<usize>,
    /// The family's trailing-token allowance.
    pub max_trim_tokens: usize,
    /// Ids → text for `response`.
    pub decode: Decode<'a>,
    /// `tito_session_mismatch` of a leaf's path (`None`: not computed, key left out).
    pub mismatch: &'a dyn Fn(NodeId) -> Option<Value>,
    /// Put the leaf's last request messages + answer on its last turn as
    /// `metadata.messages` (Miles' `--save-debug-trajectory-data`).
    pub save_debug_trajectory_data: bool,
}

impl std::fmt::Debug for LeafAssembly<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafAssembly")
            .field("max_seq_len", &self.max_seq_len)
            .field("max_trim_tokens", &self.max_trim_tokens)
            .field(
                "save_debug_trajectory_data",
                &self.save_debug_trajectory_data,
            )
            .finish()
    }
}

/// The conversation of a record: its request's messages and its answer (Miles' debug
/// `messages`).
fn record_messages(record: &crate::trajectory::SessionRecord) -> Value {
    let mut messages = record
        .request
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if let Some(message) = record.response.pointer("/choices/0/message") {
        messages.push(message.clone());
    }
    Value::Array(messages)
}

/// Miles' `build_leaf_material`: for every leaf (commit order) its path's records become
/// per-turn samples (checked against the leaf's snapshot, trailing tokens trimmed), truncated
/// to `max_seq_len`, merged into one; a leaf whose turns all truncate away is dropped. Each
/// sample's metadata gets `accumulated_token_ids` (the leaf's snapshot), `leaf` (`node_id`,
/// `parent`, `path_node_ids`, `response_id`) and `tito_session_mismatch` when computed.
/// Assembly errors ([`Error::Assembly`], 422) name what broke.
pub fn build_leaf_material(tree: &SessionTree, assembly: &LeafAssembly<'_>) -> Result<Vec<Sample>> {
    let mut material = Vec::new();
    for leaf_id in tree.leaves() {
        let path = tree.path(leaf_id);
        let records = path
            .iter()
            .map(|&i| RecordTurn::from_record(&tree.nodes()[i].record))
            .collect::<Result<Vec<_>>>()?;
        let leaf = &tree.nodes()[leaf_id];
        let mut turns = compute_samples_from_turns(
            &Sample::default(),
            &records,
            Some(&leaf.token_ids),
            assembly.max_trim_tokens,
            assembly.decode,
        )?;
        if assembly.save_debug_trajectory_data
            && let Some(last) = turns.last_mut()
        {
            last.metadata
                .insert("messages".into(), record_messages(&leaf.record));
        }
        if let Some(max) = assembly.max_seq_len {
            turns = truncate_samples_by_total_tokens(turns, max, assembly.decode)?;
        }
        if turns.is_empty() {
            continue;
        }
        let mut sample = merge_samples(turns, assembly.decode)?;
        sample
            .metadata
            .insert("accumulated_token_ids".into(), json!(leaf.token_ids));
        sample.metadata.insert(
            "leaf".into(),
            json!({
                "node_id": leaf.seq,
                "parent": leaf.parent,
                "path_node_ids": path,
                "response_id": leaf.response_id,
            }),
        );
        if let Some(mismatch) = (assembly.mismatch)(leaf_id) {
            sample
                .metadata
                .insert("tito_session_mismatch".into(), mismatch);
        }
        material.push(sample);
    }
    Ok(material)
}

/// One row of `session_metadata.tree.nodes`, typed.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRow {
    /// The node (= its `seq`).
    pub id: NodeId,
    /// Its parent.
    pub parent: Option<NodeId>,
    /// Ended at the length limit.
    pub truncated: bool,
    /// Commit wall-clock time.
    pub committed_at: f64,
    /// Its completion within its snapshot, `[start, end)`.
    pub completion_span: (usize, usize),
    /// Its snapshot's length.
    pub num_tokens: usize,
    /// The completion's `id`.
    pub response_id: String,
}

/// `session_metadata.tree`, typed (what hooks read): node rows by id and the leaf rows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TreeView {
    /// Node rows by id.
    pub nodes: BTreeMap<NodeId, NodeRow>,
    /// `(leaf id, path node ids)`, commit order.
    pub leaves: Vec<(NodeId, Vec<NodeId>)>,
}

fn bad(what: &str) -> String {
    format!("session metadata: malformed {what}")
}

fn as_id(v: &Value, what: &str) -> std::result::Result<NodeId, String> {
    v.as_u64()
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(|| bad(what))
}

fn as_ids(v: &Value, what: &str) -> std::result::Result<Vec<NodeId>, String> {
    v.as_array()
        .ok_or_else(|| bad(what))?
        .iter()
        .map(|x| as_id(x, what))
        .collect()
}

impl TreeView {
    /// Reads `session_metadata["tree"]`.
    pub fn from_metadata(
        session_metadata: &Map<String, Value>,
    ) -> std::result::Result<Self, String> {
        let tree = session_metadata.get("tree").ok_or_else(|| bad("tree"))?;
        let mut view = Self::default();
        for n in tree
            .get("nodes")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("tree.nodes"))?
        {
            let id = as_id(&n["id"], "node id")?;
            let parent = match &n["parent"] {
                Value::Null => None,
                p => Some(as_id(p, "node parent")?),
            };
            let span = as_ids(&n["completion_span"], "completion_span")?;
            let [start, end] = span[..] else {
                return Err(bad("completion_span"));
            };
            view.nodes.insert(
                id,
                NodeRow {
                    id,
                    parent,
                    truncated: n["truncated"].as_bool().unwrap_or(false),
                    committed_at: n["committed_at"].as_f64().unwrap_or(0.0),
                    completion_span: (start, end),
                    num_tokens: as_id(&n["num_tokens"], "num_tokens")?,
                    response_id: n["response_id"].as_str().unwrap_or_default().to_owned(),
                },
            );
        }
        for l in tree
            .get("leaves")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("tree.leaves"))?
        {
            view.leaves.push((
                as_id(&l["node_id"], "leaf node_id")?,
                as_ids(&l["path_node_ids"], "leaf path_node_ids")?,
            ));
        }
        Ok(view)
    }

    /// Children of each node, in commit order.
    pub fn children(&self) -> HashMap<NodeId, Vec<NodeId>> {
        let mut children: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
        for row in self.nodes.values() {
            if let Some(p) = row.parent {
                children.entry(p).or_default().push(row.id);
            }
        }
        children
    }
}

/// A leaf sample's `metadata.leaf`, typed.
#[derive(Debug, Clone, PartialEq)]
pub struct LeafDescriptor {
    /// The leaf node.
    pub node_id: NodeId,
    /// Its parent.
    pub parent: Option<NodeId>,
    /// Root → leaf.
    pub path_node_ids: Vec<NodeId>,
    /// The leaf's completion `id`.
    pub response_id: String,
}

impl LeafDescriptor {
    /// Reads `sample.metadata["leaf"]`.
    pub fn of(sample: &Sample) -> std::result::Result<Self, String> {
        let leaf = sample
            .metadata
            .get("leaf")
            .ok_or_else(|| bad("sample leaf"))?;
        Ok(Self {
            node_id: as_id(&leaf["node_id"], "leaf node_id")?,
            parent: match &leaf["parent"] {
                Value::Null => None,
                p => Some(as_id(p, "leaf parent")?),
            },
            path_node_ids: as_ids(&leaf["path_node_ids"], "leaf path_node_ids")?,
            response_id: leaf["response_id"].as_str().unwrap_or_default().to_owned(),
        })
    }
}

/// A pick hook (Miles' `--session-sample-picker-path`): a pure selection over the per-leaf
/// raw samples. It returns indices into `leaf_samples` (drop or reorder, never rewrite);
/// an index out of range or given twice is a hook failure. Inputs to read: each sample's
/// `metadata.leaf` ([`LeafDescriptor`]) and `session_metadata.tree` ([`TreeView`]).
pub trait SamplePicker: std::fmt::Debug + Send + Sync {
    /// The hook's name in error messages.
    fn name(&self) -> &str;
    /// The indices of the samples to keep, in the order to keep them.
    fn pick(
        &self,
        leaf_samples: &[Sample],
        session_metadata: &Map<String, Value>,
    ) -> std::result::Result<Vec<usize>, String>;
}

/// A post-process hook (Miles' `--session-sample-postprocessor-path`): finalizes the picked
/// samples (loss masks, metadata, rewards). It should not drop samples (selection is the
/// picker's job); an empty result is answered as `all_truncated`.
pub trait SamplePostprocessor: std::fmt::Debug + Send + Sync {
    /// The hook's name in error messages.
    fn name(&self) -> &str;
    /// The training samples.
    fn postprocess(
        &self,
        samples: Vec<Sample>,
        session_metadata: &Map<String, Value>,
    ) -> std::result::Result<Vec<Sample>, String>;
}

/// Miles' default picker `drop_retries`: a leaf with a later sibling (a node committed after
/// it under the same parent) is an abandoned attempt superseded by a retry and is trimmed;
/// every other leaf (roots included) is kept. Survivors are ordered by path length, then
/// commit order, both descending. A superseded leaf with a later wall clock than a later
/// sibling, or longer than every later sibling's deepest leaf, is logged (a warning) and
/// trimmed all the same: `seq` decides.
#[derive(Debug, Clone, Copy, Default)]
pub struct DropRetries;

impl DropRetries {
    /// [`SamplePicker::pick`] with the warnings it logs.
    pub fn pick_with_warnings(
        &self,
        leaf_samples: &[Sample],
        session_metadata: &Map<String, Value>,
    ) -> std::result::Result<(Vec<usize>, Vec<String>), String> {
        let view = TreeView::from_metadata(session_metadata)?;
        let children = view.children();
        let node = |id: NodeId| view.nodes.get(&id).ok_or_else(|| bad("node reference"));
        let mut kept: Vec<(usize, usize, NodeId)> = Vec::new();
        let mut warnings = Vec::new();
        for (k, sample) in leaf_samples.iter().enumerate() {
            let leaf = LeafDescriptor::of(sample)?;
            let later: Vec<NodeId> = match leaf.parent {
                None => Vec::new(),
                Some(p) => children
                    .get(&p)
                    .map(|c| c.iter().copied().filter(|&s| s > leaf.node_id).collect())
                    .unwrap_or_default(),
            };
            if later.is_empty() {
                kept.push((k, leaf.path_node_ids.len(), leaf.node_id));
                continue;
            }
            let me = node(leaf.node_id)?;
            let mut regressions = Vec::new();
            for &sibling in &later {
                let t = node(sibling)?.committed_at;
                if t < me.committed_at {
                    regressions.push(format!(
                        "({sibling}, {})",
                        miles_core::python::float_repr(t)
                    ));
                }
            }
            if !regressions.is_empty() {
                warnings.push(format!(
                    "Default picker detected wall-clock rollback for superseded leaf \
                     (response_id='{}', seq={}, committed_at={}); later siblings=[{}]; continuing by seq",
                    leaf.response_id,
                    leaf.node_id,
                    miles_core::python::float_repr(me.committed_at),
                    regressions.join(", ")
                ));
            }
            let survivors_max = view
                .leaves
                .iter()
                .filter(|(_, path)| later.iter().any(|s| path.contains(s)))
                .filter_map(|(id, _)| view.nodes.get(id).map(|n| n.num_tokens))
                .max()
                .unwrap_or(0);
            if me.num_tokens > survivors_max {
                warnings.push(format!(
                    "Default picker trimming superseded leaf (response_id='{}', seq={}) even though \
                     it is longer than every later sibling's deepest leaf ({} > {} tokens); \
                     continuing by seq; use a custom picker to keep it",
                    leaf.response_id, leaf.node_id, me.num_tokens, survivors_max
                ));
            }
        }
        kept.sort_by_key(|k| std::cmp::Reverse((k.1, k.2)));
        Ok((kept.into_iter().map(|(k, _, _)| k).collect(), warnings))
    }
}

impl SamplePicker for DropRetries {
    fn name(&self) -> &str {
        "drop_retries"
    }

    fn pick(
        &self,
        leaf_samples: &[Sample],
        session_metadata: &Map<String, Value>,
    ) -> std::result::Result<Vec<usize>, String> {
        let (kept, warnings) = self.pick_with_warnings(leaf_samples, session_metadata)?;
        for warning in warnings {
            tracing::warn!("{warning}");
        }
        Ok(kept)
    }
}

/// Keeps every leaf, in commit order (a tree-RL picker: abandoned attempts train too).
#[derive(Debug, Clone, Copy, Default)]
pub struct KeepAllLeaves;

impl SamplePicker for KeepAllLeaves {
    fn name(&self) -> &str {
        "keep_all_leaves"
    }

    fn pick(
        &self,
        leaf_samples: &[Sample],
        _session_metadata: &Map<String, Value>,
    ) -> std::result::Result<Vec<usize>, String> {
        Ok((0..leaf_samples.len()).collect())
    }
}

/// Miles' default post-processor `default_postprocess`:
///
/// * exactly-once completions: a node's completion on the path of several kept leaves is
///   trained (loss mask 1) only in the sample of the earliest committed one (smallest leaf
///   id); the others mask its span (clamped to the response, which truncation may cut);
/// * the agent's metadata (`session_metadata.agent`, sent with the samples request) is merged
///   into every sample's, except the server-owned keys ([`SERVER_OWNED_METADATA_KEYS`]);
/// * the agent's `reward`, when given, becomes every kept sample's reward (a number or an
///   object; anything else fails the hook).
///
/// The order of the samples is kept.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultPostprocess;

impl SamplePostprocessor for DefaultPostprocess {
    fn name(&self) -> &str {
        "default_postprocess"
    }

    fn postprocess(
        &self,
        mut samples: Vec<Sample>,
        session_metadata: &Map<String, Value>,
    ) -> std::result::Result<Vec<Sample>, String> {
        let view = TreeView::from_metadata(session_metadata)?;
        let empty = Map::new();
        let agent = session_metadata
            .get("agent")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let reward =
            match agent.get("reward") {
                None | Some(Value::Null) => None,
                Some(value) => Some(serde_json::from_value::<Reward>(value.clone()).map_err(
                    |_| format!("agent reward must be a number or an object, got {value}"),
                )?),
            };
        let leaves = samples
            .iter()
            .map(LeafDescriptor::of)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut owner: HashMap<NodeId, NodeId> = HashMap::new();
        for leaf in &leaves {
            for &node in &leaf.path_node_ids {
                let o = owner.entry(node).or_insert(leaf.node_id);
                *o = (*o).min(leaf.node_id);
            }
        }
        for (sample, leaf) in samples.iter_mut().zip(&leaves) {
            let response_length = sample.response_length;
            let response_start = sample.tokens.len().saturating_sub(response_length) as i64;
            let mask = sample
                .loss_mask
                .get_or_insert_with(|| vec![1; response_length]);
            for node in &leaf.path_node_ids {
                if owner.get(node) == Some(&leaf.node_id) {
                    continue;
                }
                let row = view.nodes.get(node).ok_or_else(|| bad("node reference"))?;
                let (start, end) = row.completion_span;
                let lo = (start as i64 - response_start).max(0);
                let hi = (end as i64 - response_start).min(response_length as i64);
                if hi > lo {
                    for m in mask.iter_mut().take(hi as usize).skip(lo as usize) {
                        *m = 0;
                    }
                }
            }
            let server: Vec<(String, Value)> = SERVER_OWNED_METADATA_KEYS
                .iter()
                .filter_map(|k| {
                    sample
                        .metadata
                        .get(*k)
                        .map(|v| ((*k).to_owned(), v.clone()))
                })
                .collect();
            for (key, value) in agent {
                if !SERVER_OWNED_METADATA_KEYS.contains(&key.as_str()) {
                    sample.metadata.insert(key.clone(), value.clone());
                }
            }
            for (key, value) in server {
                sample.metadata.insert(key, value);
            }
            if let Some(reward) = &reward {
                sample.reward = Some(reward.clone());
            }
        }
        Ok(samples)
    }
}

/// The two hooks of the samples op.
#[derive(Debug, Clone)]
pub struct SampleHooks {
    /// The picker (default [`DropRetries`]).
    pub picker: Arc<dyn SamplePicker>,
    /// The post-processor (default [`DefaultPostprocess`]).
    pub postprocessor: Arc<dyn SamplePostprocessor>,
}

impl Default for SampleHooks {
    fn default() -> Self {
        Self {
            picker: Arc::new(DropRetries),
            postprocessor: Arc::new(DefaultPostprocess),
        }
    }
}

impl SampleHooks {
    fn failure(&self, reason: impl Into<String>) -> Error {
        Error::SampleHook {
            picker: self.picker.name().to_owned(),
            postprocessor: self.postprocessor.name().to_owned(),
            reason: reason.into(),
        }
    }
}

/// A tree session's metadata (Miles' v2 `_session_metadata`): `tito_session_mismatch` of the
/// viewed path (when computed), its `accumulated_token_ids`, `max_trim_tokens`, and `tree`.
pub fn session_metadata(
    trajectory: &TreeTrajectory,
    max_trim_tokens: usize,
    active_mismatch: Option<Value>,
) -> Map<String, Value> {
    let mut meta = Map::new();
    if let Some(found) = active_mismatch {
        meta.insert("tito_session_mismatch".into(), found);
    }
    meta.insert(
        "accumulated_token_ids".into(),
        json!(trajectory.active_token_ids()),
    );
    meta.insert("max_trim_tokens".into(), json!(max_trim_tokens));
    meta.insert("tree".into(), tree_metadata(trajectory.tree()));
    meta
}

/// Miles' v2 samples op: `session_metadata` (from [`session_metadata`]) gets the agent's
/// metadata under `agent` when given; no node → `no_records`; the leaf material
/// ([`build_leaf_material`]; assembly errors are 422); none left → `all_truncated`; the
/// picker, then the post-processor ([`Error::SampleHook`] on failure); none left →
/// `all_truncated`. Encode the payload with [`crate::codec::SamplesWire::V2`].
pub fn collect_tree_samples(
    tree: &SessionTree,
    mut session_metadata: Map<String, Value>,
    agent_metadata: Option<Value>,
    assembly: &LeafAssembly<'_>,
    hooks: &SampleHooks,
) -> Result<SamplesPayload> {
    if let Some(agent) = agent_metadata {
        session_metadata.insert("agent".into(), agent);
    }
    let empty = |session_metadata, reason| SamplesPayload {
        samples: Vec::new(),
        session_metadata,
        empty_reason: Some(reason),
    };
    if tree.nodes().is_empty() {
        return Ok(empty(session_metadata, EmptyReason::NoRecords));
    }
    let material = build_leaf_material(tree, assembly)?;
    if material.is_empty() {
        return Ok(empty(session_metadata, EmptyReason::AllTruncated));
    }
    let picked = hooks
        .picker
        .pick(&material, &session_metadata)
        .map_err(|e| hooks.failure(e))?;
    let mut seen = vec![false; material.len()];
    for &k in &picked {
        if k >= material.len() || std::mem::replace(&mut seen[k], true) {
            return Err(hooks.failure(
                "pick hook must return a subset of its input samples without duplicates (pure selection)",
            ));
        }
    }
    let mut slots: Vec<Option<Sample>> = material.into_iter().map(Some).collect();
    let picked: Vec<Sample> = picked.iter().filter_map(|&k| slots[k].take()).collect();
    let samples = hooks
        .postprocessor
        .postprocess(picked, &session_metadata)
        .map_err(|e| hooks.failure(e))?;
    if samples.is_empty() {
        return Ok(empty(session_metadata, EmptyReason::AllTruncated));
    }
    for (k, sample) in samples.iter().enumerate() {
        sample
            .validate()
            .map_err(|e| hooks.failure(format!("sample {k} is invalid: {e}")))?;
    }
    Ok(SamplesPayload {
        samples,
        session_metadata,
        empty_reason: None,
    })
}
