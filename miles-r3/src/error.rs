//! The crate's error type.

/// Errors of the routing-replay layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum R3Error {
    /// The selection scores handed to a hook do not have the shape the layer announced.
    #[error("layer {layer}: selection scores have shape {got:?}, expected [tokens, {num_experts}]")]
    ScoreShape {
        /// Model layer index.
        layer: usize,
        /// Number of routed experts of the layer.
        num_experts: usize,
        /// Shape that was received.
        got: Vec<usize>,
    },
    /// `top_k` is zero or larger than the number of experts.
    #[error("layer {layer}: top_k {top_k} is not in 1..={num_experts}")]
    InvalidTopK {
        /// Model layer index.
        layer: usize,
        /// Requested number of experts per token.
        top_k: usize,
        /// Number of routed experts of the layer.
        num_experts: usize,
    },
    /// The MoE-layer description of a model is inconsistent.
    #[error("invalid MoE model description: {reason}")]
    InvalidModel {
        /// What is wrong.
        reason: String,
    },
    /// More experts than the compact `u16` form can hold (ids up to 65 534).
    #[error("{num_experts} experts do not fit the compact u16 id form (at most 65535)")]
    TooManyExperts {
        /// Number of routed experts.
        num_experts: usize,
    },
    /// A sample placed in a batch carries no `rollout_routed_experts`.
    #[error("sample {sample} has no rollout_routed_experts")]
    MissingRouting {
        /// Index of the sample in the slice handed over.
        sample: usize,
    },
    /// A sample's routing table does not have `tokens − 1` rows.
    #[error("sample {sample}: routing table has {got} rows, its {tokens} tokens need {expected}")]
    RowMismatch {
        /// Index of the sample.
        sample: usize,
        /// Number of tokens of the sample.
        tokens: usize,
        /// Expected rows (`tokens − 1`).
        expected: usize,
        /// Rows in the table.
        got: usize,
    },
    /// A sample's routing table has neither the model's layer count nor its MoE-layer count.
    #[error(
        "sample {sample}: routing table has {got} layers, the model has {num_layers} layers \
         ({moe_layers} MoE)"
    )]
    LayerMismatch {
        /// Index of the sample.
        sample: usize,
        /// Layers in the table.
        got: usize,
        /// All layers of the model.
        num_layers: usize,
        /// MoE layers of the model.
        moe_layers: usize,
    },
    /// A routing table's top-k differs from the model's.
    #[error("sample {sample}: routing table has top_k {got}, the model routes to {expected}")]
    TopKMismatch {
        /// Index of the sample (or of the micro-batch for tables pushed to a replay).
        sample: usize,
        /// Width of the table.
        got: usize,
        /// The model's `num_experts_per_tok`.
        expected: usize,
    },
    /// An expert id outside `-1..num_experts`.
    #[error(
        "sample {sample}, row {row}, layer {layer}: expert id {expert} is outside \
         0..{num_experts} (or -1 for padding)"
    )]
    ExpertOutOfRange {
        /// Index of the sample.
        sample: usize,
        /// Row (forwarded position) in the sample's table.
        row: usize,
        /// Model layer index.
        layer: usize,
        /// The offending id.
        expert: i64,
        /// Number of routed experts.
        num_experts: usize,
    },
    /// A batch layout names a sample that does not exist or names one twice.
    #[error("batch layout: sample {sample} {reason} ({num_samples} samples)")]
    LayoutSample {
        /// The sample index in the layout.
        sample: usize,
        /// `"is out of range"` or `"appears twice"`.
        reason: &'static str,
        /// Number of samples handed over.
        num_samples: usize,
    },
    /// The samples packed into one batch row do not fit its length.
    #[error("batch layout: row {row} holds {tokens} tokens, longer than seq_len {seq_len}")]
    RowOverflow {
        /// Batch row.
        row: usize,
        /// Tokens placed in it.
        tokens: usize,
        /// Row length.
        seq_len: usize,
    },
    /// A table pushed to a [`crate::RoutingReplay`] does not match the model.
    #[error("replay table is [{rows}, {moe_layers}, {top_k}] over {num_experts} experts: {reason}")]
    TableMismatch {
        /// Rows of the table.
        rows: usize,
        /// MoE layers of the table.
        moe_layers: usize,
        /// Width of the table.
        top_k: usize,
        /// Expert count of the table.
        num_experts: usize,
        /// What does not match.
        reason: String,
    },
    /// A MoE layer unknown to the replay called the hook.
    #[error("layer {layer_index} (MoE index {moe_index}) is not a MoE layer of this replay")]
    UnknownLayer {
        /// Model layer index.
        layer_index: usize,
        /// Index among MoE layers.
        moe_index: usize,
    },
    /// Replay asked for more micro-batches than were loaded.
    #[error("layer {layer}: {stage} replay cursor {cursor} past the {loaded} loaded micro-batches")]
    ReplayExhausted {
        /// Model layer index.
        layer: usize,
        /// `"forward"` or `"backward"`.
        stage: &'static str,
        /// The cursor position.
        cursor: usize,
        /// Micro-batches loaded for the layer.
        loaded: usize,
    },
    /// The replayed routing has a different token count than the forward pass.
    #[error("layer {layer}: replay holds {replay_rows} rows, the forward pass has {tokens} tokens")]
    ReplayRows {
        /// Model layer index.
        layer: usize,
        /// Rows in the replayed micro-batch.
        replay_rows: usize,
        /// Tokens of the forward pass.
        tokens: usize,
    },
    /// The optional replay check (Miles' `check_replay_result`) found too many tokens whose
    /// replayed experts share none with the trainer's own choice.
    #[error(
        "layer {layer}: {mismatched} of {tokens} tokens have no expert in common with the \
         trainer's routing (threshold {threshold})"
    )]
    ReplayCheck {
        /// Model layer index.
        layer: usize,
        /// Zero-overlap tokens.
        mismatched: usize,
        /// Tokens checked.
        tokens: usize,
        /// Allowed fraction.
        threshold: f64,
    },
    /// Reading back routing from the device failed.
    #[error("layer {layer}: cannot read expert ids back from the device: {reason}")]
    Readback {
        /// Model layer index.
        layer: usize,
        /// The backend's message.
        reason: String,
    },
    /// A lock around the replay state was poisoned by a panic in another thread.
    #[error("replay state lock poisoned")]
    Poisoned,
}
