//! Tree sessions (Miles' session server v2, `--use-session-server v2`): one session's
//! append-only forest of generations and the serving policy on top of it.
//!
//! Every committed chat completion is a [`TreeNode`]: the messages it added to its parent's
//! path (`delta_messages`, the assistant answer last), the full root→node token snapshot, the
//! span of its sampled completion, its record. A request never rolls anything back: it
//! attaches at the deepest node whose whole path is a prefix of its messages
//! ([`SessionTree::find_attach_point`]), and its unmatched suffix becomes a new child there
//! (a sibling of an earlier attempt, or a new root when not even the first node matches).
//! Retries, edited history, compaction and sub-agents therefore keep every earlier turn;
//! which leaves become training samples is decided later by the sample picker
//! ([`crate::tree_samples`]).
//!
//! `seq` (commit order, = the node's index) is the only ordering key; `committed_at` is wall
//! clock, decoration only. [`TreeTrajectory`] is a session's tree plus its *view*
//! (`active_leaf`, the head of the path that `GET /sessions/{id}` and the mismatch metric
//! see), and the three serving steps: [`TreeTrajectory::position`],
//! [`TreeTrajectory::prepare`], [`TreeTrajectory::commit`].

use miles_core::{Message, Role, TokenId, ToolSpec};
use miles_tito::{ChatTokenizer, MessageMatcher};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::trajectory::{SessionRecord, check_pretokenized_prefix};

/// Which session server serves the sessions (Miles' `--use-session-server [v1|v2]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SessionVersion {
    /// The append-only linear server with one-step rollback ([`crate::trajectory`]; Miles'
    /// default: the bare flag or `v1`).
    #[default]
    V1,
    /// Tree sessions: every divergence branches, every kept leaf is a sample (this module).
    V2,
}

impl SessionVersion {
    /// `v1` / `v2`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
        }
    }

    /// The samples wire format its samples route answers with.
    pub fn wire(self) -> crate::codec::SamplesWire {
        match self {
            Self::V1 => crate::codec::SamplesWire::V1,
            Self::V2 => crate::codec::SamplesWire::V2,
        }
    }
}

impl std::fmt::Display for SessionVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SessionVersion {
    type Err = Error;

    /// Miles' values: `v1` (or `true`, what the bare flag stores, or the empty string) and
    /// `v2`; anything else is [`Error::Config`] with Miles' message.
    fn from_str(value: &str) -> Result<Self> {
        match value {
            "v1" | "true" | "True" | "" => Ok(Self::V1),
            "v2" => Ok(Self::V2),
            other => Err(Error::Config(format!(
                "--use-session-server={other:?} is not a known session server version; pass it \
                 bare (or 'v1') for the append-only linear server, or 'v2' for tree serving."
            ))),
        }
    }
}

/// Miles' `MAX_NODES`: the default cap on a session's nodes (generations, all branches).
pub const MAX_TREE_NODES: usize = 1024;

/// A node's index in its tree, equal to its `seq` (commit order).
pub type NodeId = usize;

/// The end of one model generation (1:1 with its [`SessionRecord`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TreeNode {
    /// The messages this generation added to its parent's path: the request's unmatched
    /// suffix, then the assistant answer.
    pub delta_messages: Vec<Message>,
    /// The full root→node token snapshot (prompt + completion of this generation).
    pub token_ids: Vec<TokenId>,
    /// This node's sampled completion within `token_ids`, `[start, end)`.
    pub completion_span: (usize, usize),
    /// Commit order, the only ordering key (= the node's [`NodeId`]).
    pub seq: NodeId,
    /// Commit wall-clock time, seconds since the Unix epoch (decoration only).
    pub committed_at: f64,
    /// The completion's `id` as the agent saw it: the branch ↔ leaf join key.
    pub response_id: String,
    /// The committed record.
    pub record: SessionRecord,
    /// The generation's finish reason (`stop`, `tool_calls`, `length`, `abort`).
    pub finish_reason: String,
    /// The parent node; `None` for a root.
    pub parent: Option<NodeId>,
    /// The children, in commit order.
    pub children: Vec<NodeId>,
}

impl TreeNode {
    /// A generation cut at the length limit: its path cannot be extended.
    pub fn truncated(&self) -> bool {
        self.finish_reason == "length"
    }
}

/// What [`SessionTree::create_node`] needs for a new node (the tree sets `seq`, `parent`,
/// `children`).
#[derive(Debug, Clone, PartialEq)]
pub struct NewNode {
    /// See [`TreeNode::delta_messages`].
    pub delta_messages: Vec<Message>,
    /// See [`TreeNode::token_ids`].
    pub token_ids: Vec<TokenId>,
    /// See [`TreeNode::completion_span`].
    pub completion_span: (usize, usize),
    /// See [`TreeNode::committed_at`].
    pub committed_at: f64,
    /// See [`TreeNode::response_id`].
    pub response_id: String,
    /// See [`TreeNode::record`].
    pub record: SessionRecord,
    /// See [`TreeNode::finish_reason`].
    pub finish_reason: String,
}

/// Where a request attaches (Miles' `AttachPoint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttachPoint {
    /// The deepest node whose whole path matches a prefix of the request; `None`: a new root.
    pub node: Option<NodeId>,
    /// Request messages consumed by that node's path.
    pub matched_messages: usize,
    /// Diagnostics: the deepest overlap seen, partial deltas included.
    pub best_overlap: usize,
}

/// A session's forest of generations: append-only, bounded by its node cap.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionTree {
    nodes: Vec<TreeNode>,
    roots: Vec<NodeId>,
    max_nodes: usize,
}

impl Default for SessionTree {
    fn default() -> Self {
        Self::new()
    }
}

impl SessionTree {
    /// An empty tree with Miles' cap ([`MAX_TREE_NODES`]).
    pub fn new() -> Self {
        Self::with_max_nodes(MAX_TREE_NODES)
    }

    /// An empty tree holding at most `max_nodes` nodes.
    pub fn with_max_nodes(max_nodes: usize) -> Self {
        Self {
            nodes: Vec::new(),
            roots: Vec::new(),
            max_nodes,
        }
    }

    /// The node cap.
    pub fn max_nodes(&self) -> usize {
        self.max_nodes
    }

    /// Every node, in commit (`seq`) order.
    pub fn nodes(&self) -> &[TreeNode] {
        &self.nodes
    }

    /// A node by id.
    pub fn node(&self, id: NodeId) -> Option<&TreeNode> {
        self.nodes.get(id)
    }

    /// The roots, in commit order.
    pub fn roots(&self) -> &[NodeId] {
        &self.roots
    }

    /// The nodes without children, in commit order.
    pub fn leaves(&self) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|n| n.children.is_empty())
            .map(|n| n.seq)
            .collect()
    }

    /// The path root → `id` (empty for an unknown id).
    pub fn path(&self, id: NodeId) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut at = self.nodes.get(id).map(|n| n.seq);
        while let Some(node) = at.and_then(|i| self.nodes.get(i)) {
            path.push(node.seq);
            at = node.parent;
        }
        path.reverse();
        path
    }

    /// The messages of the path root → `id` (every node's delta, in order).
    pub fn path_messages(&self, id: NodeId) -> Vec<Message> {
        self.path(id)
            .into_iter()
            .flat_map(|i| self.nodes[i].delta_messages.iter().cloned())
            .collect()
    }

    /// Appends a node under `parent` (`None`: a new root). Errors: the node cap is reached
    /// ([`Error::SessionLimit`], Miles' text), or `parent` is not a node of this tree.
    pub fn create_node(&mut self, parent: Option<NodeId>, node: NewNode) -> Result<NodeId> {
        if self.nodes.len() >= self.max_nodes {
            return Err(node_cap_error(self.max_nodes));
        }
        if let Some(p) = parent
            && p >= self.nodes.len()
        {
            return Err(Error::validation(format!(
                "parent node {p} is not in the session tree ({} nodes)",
                self.nodes.len()
            )));
        }
        let seq = self.nodes.len();
        self.nodes.push(TreeNode {
            delta_messages: node.delta_messages,
            token_ids: node.token_ids,
            completion_span: node.completion_span,
            seq,
            committed_at: node.committed_at,
            response_id: node.response_id,
            record: node.record,
            finish_reason: node.finish_reason,
            parent,
            children: Vec::new(),
        });
        match parent {
            None => self.roots.push(seq),
            Some(p) => self.nodes[p].children.push(seq),
        }
        Ok(seq)
    }

    /// Miles' `find_attach_point`: the deepest node whose full path messages are a prefix of
    /// `request` under `matcher` (stored message first). A node is entered only once its
    /// parent's delta is fully consumed; ties on depth (twins whose deltas both match) go to
    /// the latest `seq`. Changes nothing.
    pub fn find_attach_point(&self, request: &[Message], matcher: MessageMatcher) -> AttachPoint {
        let mut best: Option<NodeId> = None;
        let mut best_matched = 0usize;
        let mut best_overlap = 0usize;
        let mut stack: Vec<(NodeId, usize)> = self.roots.iter().rev().map(|&r| (r, 0)).collect();
        while let Some((id, offset)) = stack.pop() {
            let node = &self.nodes[id];
            let delta = &node.delta_messages;
            let i = delta
                .iter()
                .zip(request.get(offset..).unwrap_or(&[]))
                .take_while(|(stored, new)| matcher.matches(stored, new))
                .count();
            best_overlap = best_overlap.max(offset + i);
            if i < delta.len() {
                continue;
            }
            let matched = offset + delta.len();
            let better = match best {
                None => true,
                Some(b) => matched > best_matched || (matched == best_matched && id > b),
            };
            if better {
                best = Some(id);
                best_matched = matched;
            }
            stack.extend(node.children.iter().rev().map(|&c| (c, matched)));
        }
        AttachPoint {
            node: best,
            matched_messages: if best.is_some() { best_matched } else { 0 },
            best_overlap,
        }
    }
}

fn node_cap_error(cap: usize) -> Error {
    Error::SessionLimit {
        reason: format!(
            "node cap reached ({cap}): the session cannot branch or extend further — this almost \
             always means the harness is not replaying history verbatim"
        ),
    }
}

/// One tree session: its forest and its view (Miles' `SessionStateV2` without the lock,
/// which the server holds around it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TreeTrajectory {
    tree: SessionTree,
    active_leaf: Option<NodeId>,
}

impl TreeTrajectory {
    /// An empty session whose tree holds at most `max_nodes` nodes.
    pub fn with_max_nodes(max_nodes: usize) -> Self {
        Self {
            tree: SessionTree::with_max_nodes(max_nodes),
            active_leaf: None,
        }
    }

    /// A session over an existing tree, viewing `active_leaf` (an unknown id views nothing).
    pub fn from_tree(tree: SessionTree, active_leaf: Option<NodeId>) -> Self {
        let active_leaf = active_leaf.filter(|&id| id < tree.nodes.len());
        Self { tree, active_leaf }
    }

    /// The forest.
    pub fn tree(&self) -> &SessionTree {
        &self.tree
    }

    /// The head of the view (`None`: no generation viewed yet).
    pub fn active_leaf(&self) -> Option<NodeId> {
        self.active_leaf
    }

    /// The viewed path's records (what `GET /sessions/{id}` lists).
    pub fn active_records(&self) -> Vec<&SessionRecord> {
        self.active_leaf
            .map(|id| self.tree.path(id))
            .unwrap_or_default()
            .into_iter()
            .map(|i| &self.tree.nodes[i].record)
            .collect()
    }

    /// The viewed path's messages.
    pub fn active_messages(&self) -> Vec<Message> {
        self.active_leaf
            .map(|id| self.tree.path_messages(id))
            .unwrap_or_default()
    }

    /// The viewed path's token snapshot (empty when nothing is viewed).
    pub fn active_token_ids(&self) -> &[TokenId] {
        self.active_leaf
            .and_then(|id| self.tree.node(id))
            .map_or(&[], |n| n.token_ids.as_slice())
    }

    /// Miles' `position_for_request`: moves the view to `request`'s attach point. A request
    /// that would extend a generation cut at the length limit is refused
    /// ([`Error::TruncatedGeneration`], 409) and leaves the view where it was.
    pub fn position(
        &mut self,
        request: &[Message],
        matcher: MessageMatcher,
    ) -> Result<AttachPoint> {
        let attach = self.tree.find_attach_point(request, matcher);
        if let Some(node) = attach.node.and_then(|id| self.tree.node(id))
            && node.truncated()
        {
            return Err(Error::TruncatedGeneration {
                reason: "truncated generation cannot be extended: the matched node ended with \
                         finish_reason='length' and truncation closes that path for good; branch \
                         before the cut instead"
                    .into(),
            });
        }
        if attach.node != self.active_leaf {
            tracing::debug!(
                request_messages = request.len(),
                attach = ?attach.node,
                matched = attach.matched_messages,
                best_overlap = attach.best_overlap,
                nodes = self.tree.nodes.len(),
                "tree session branching"
            );
        }
        self.active_leaf = attach.node;
        Ok(attach)
    }

    /// Miles' `prepare_pretokenized`: the prompt ids for `request` at the current view. No
    /// viewed node: the whole request rendered; otherwise the viewed node's snapshot reused as
    /// is and only the request's new suffix tokenized on top (its roles must be ones the
    /// family can append). Changes nothing.
    pub fn prepare(
        &self,
        request: &[Message],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
        tokenizer: &dyn ChatTokenizer,
    ) -> Result<Vec<TokenId>> {
        if request.is_empty() {
            return Err(Error::validation("messages must not be empty"));
        }
        let Some(parent) = self.active_leaf.and_then(|id| self.tree.node(id)) else {
            return Ok(tokenizer.render(request, tools, true, kwargs)?);
        };
        let stored = self.active_messages();
        let suffix = request.get(stored.len()..).unwrap_or(&[]);
        validate_suffix_roles(suffix, tokenizer.allowed_append_roles())?;
        let mut effective = stored.clone();
        effective.extend_from_slice(suffix);
        Ok(tokenizer.merge_tokens(&stored, &effective, &parent.token_ids, tools, kwargs)?)
    }

    /// Miles' `commit_generation`: checks that `prompt ⊕ completion` extends `parent`'s
    /// snapshot (all but its last `max_trim_tokens` tokens), appends the generation under
    /// `parent` (the view captured when the turn was prepared, so concurrent turns from one
    /// spot become siblings) and moves the view to it. On error nothing changes.
    pub fn commit(&mut self, parent: Option<NodeId>, turn: CommitTurn<'_>) -> Result<NodeId> {
        let parent_node = match parent {
            Some(id) => Some(self.tree.node(id).ok_or_else(|| {
                Error::validation(format!("parent node {id} is not in the session tree"))
            })?),
            None => None,
        };
        let prev: &[TokenId] = parent_node.map_or(&[], |n| n.token_ids.as_slice());
        let mut all = turn.prompt_ids.to_vec();
        all.extend_from_slice(turn.completion_ids);
        let parent_messages = parent
            .map(|id| self.tree.path_messages(id))
            .unwrap_or_default();
        check_pretokenized_prefix(
            prev,
            &all,
            turn.max_trim_tokens,
            parent_messages.len(),
            turn.request.len(),
        )?;
        let mut delta: Vec<Message> = turn
            .request
            .get(parent_messages.len()..)
            .unwrap_or(&[])
            .to_vec();
        delta.push(turn.assistant);
        let id = self.tree.create_node(
            parent,
            NewNode {
                delta_messages: delta,
                token_ids: all,
                completion_span: (
                    turn.prompt_ids.len(),
                    turn.prompt_ids.len() + turn.completion_ids.len(),
                ),
                committed_at: turn.record.timestamp,
                response_id: turn.response_id,
                record: turn.record,
                finish_reason: turn.finish_reason,
            },
        )?;
        self.active_leaf = Some(id);
        Ok(id)
    }

    /// Whether one more node fits under the cap.
    pub fn has_room(&self) -> Result<()> {
        if self.tree.nodes.len() >= self.tree.max_nodes {
            Err(node_cap_error(self.tree.max_nodes))
        } else {
            Ok(())
        }
    }
}

/// What [`TreeTrajectory::commit`] appends.
#[derive(Debug)]
pub struct CommitTurn<'a> {
    /// The request's messages.
    pub request: &'a [Message],
    /// The parsed assistant answer.
    pub assistant: Message,
    /// The prompt ids sent to the engine.
    pub prompt_ids: &'a [TokenId],
    /// The generated ids.
    pub completion_ids: &'a [TokenId],
    /// The family's trailing-token allowance.
    pub max_trim_tokens: usize,
    /// The record to keep.
    pub record: SessionRecord,
    /// The completion's `id`.
    pub response_id: String,
    /// The finish reason (`length` closes the path).
    pub finish_reason: String,
}

/// Miles' `_validate_suffix_roles`, with its text.
fn validate_suffix_roles(suffix: &[Message], allowed: &[Role]) -> Result<()> {
    for message in suffix {
        if !allowed.contains(&message.role) {
            let mut names: Vec<&str> = allowed.iter().map(|r| r.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            let list = names
                .iter()
                .map(|n| format!("'{n}'"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(Error::validation(format!(
                "appended message role='{}' not allowed (allowed=[{list}]); the selected TITO \
                 fixed template does not support appending this role",
                message.role.as_str()
            )));
        }
    }
    Ok(())
}
