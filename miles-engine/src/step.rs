//! The model step: prefill and batched decode forwards, the log-prob scorer, routing rows.

use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use miles_bridge::{CausalLm, DecodeWeights, ModelInput, MoeDispatch};
use miles_ops::fused::FusedLogProbConfig;
use miles_r3::Fallthrough;

/// Computes the log-probs of the last `response_length` tokens of `tokens` in one pass over
/// the whole sequence. The engine calls it on its scheduler thread with the weights that
/// generated the sequence.
pub trait SequenceScorer: Send + Sync {
    /// `log p(tokens[n − R + i] | tokens[..n − R + i])` for `i < R`.
    fn score(
        &self,
        model: &CausalLm,
        tokens: &[u32],
        response_length: usize,
    ) -> Result<Vec<f32>, String>;
}

/// The default scorer: the trainer's own sequence scoring (miles-bridge's
/// [`score_log_probs`](miles_bridge::score_log_probs), which miles-train's actor scores with),
/// batch-invariant and with the trainer's fused log-probs. Rollout log-probs then equal the
/// trainer's `per_sample` log-probs of the same weights bit for bit
/// (`train/train_rollout_logprob_abs_diff` = 0) with no glue; set `fused` to the trainer's
/// [`FusedLogProbConfig`] when it is not the default.
#[derive(Debug, Clone, Default)]
pub struct TrainerScorer {
    /// The fused log-prob settings the trainer uses.
    pub fused: FusedLogProbConfig,
}

impl SequenceScorer for TrainerScorer {
    fn score(
        &self,
        model: &CausalLm,
        tokens: &[u32],
        response_length: usize,
    ) -> Result<Vec<f32>, String> {
        miles_bridge::score_log_probs(model, tokens, response_length, &Fallthrough, &self.fused)
            .map_err(|e| e.to_string())
    }
}

/// A plain scorer: one full forward at the sequence's length, log-softmax, gather (no fused
/// ops; equal to the trainer's log-probs only to float rounding).
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillScorer;

impl SequenceScorer for PrefillScorer {
    fn score(
        &self,
        model: &CausalLm,
        tokens: &[u32],
        response_length: usize,
    ) -> Result<Vec<f32>, String> {
        let n = tokens.len();
        if response_length == 0 || response_length >= n {
            return Err(format!(
                "response of {response_length} tokens in a sequence of {n}"
            ));
        }
        let device = model.lm_head_weight().device();
        let ids = ids_row(tokens, &device);
        let out = model
            .forward(&ModelInput::new(ids), &Fallthrough)
            .map_err(|e| e.to_string())?;
        let [_, _, vocab] = out.logits.dims();
        let rows =
            out.logits
                .reshape([n, vocab])
                .narrow(0, n - 1 - response_length, response_length);
        let targets = Tensor::<1, Int>::from_data(
            TensorData::new(
                tokens[n - response_length..]
                    .iter()
                    .map(|&t| t as i32)
                    .collect(),
                [response_length],
            ),
            &device,
        )
        .reshape([response_length, 1]);
        log_softmax(rows, 1)
            .gather(1, targets)
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| format!("{e:?}"))
    }
}

pub(crate) fn ids_row(tokens: &[u32], device: &Device) -> Tensor<2, Int> {
    Tensor::from_data(
        TensorData::new(
            tokens.iter().map(|&t| t as i32).collect(),
            [1, tokens.len()],
        ),
        device,
    )
}

/// One host read of a forward step's outputs: the `logits` (row-major, as `f32`) and, when
/// `routing` is not empty, every MoE layer's chosen experts as rows of `[layers × top_k]`
/// ids, one row per token of the step in row-major `[batch, seq]` order (the order the
/// engine stores routing in). On flex these are plain copies; on other devices the expert
/// ids travel as `f32` (exact: ids are far below 2^24) in the same buffer as `f32` logits,
/// so a step costs one device synchronisation instead of one per MoE layer plus one.
pub(crate) fn read_step(
    logits: Option<Tensor<2>>,
    routing: &[miles_bridge::MoeRouting],
) -> Result<(Vec<f32>, Vec<i32>), String> {
    let read_f32 = |t: Tensor<1>| {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| format!("{e:?}"))
    };
    let flat = |t: Tensor<2>| {
        let n = t.shape().num_elements();
        t.reshape([n])
    };
    let routes = (!routing.is_empty()).then(|| {
        let rows = Tensor::cat(routing.iter().map(|r| r.experts.clone()).collect(), 1);
        let n = rows.shape().num_elements();
        rows.reshape([n])
    });
    let (logits, routes) = match (logits, routes) {
        (None, None) => return Ok((Vec::new(), Vec::new())),
        (Some(logits), None) => return Ok((read_f32(flat(logits))?, Vec::new())),
        (logits, Some(routes)) => (logits, routes),
    };
    let device = routes.device();
    let one_read = !miles_ops::device::reads_are_free(&device)
        && logits.as_ref().is_none_or(|l| l.dtype() == DType::F32);
    if one_read {
        let logits = logits.map(flat);
        let n = logits.as_ref().map_or(0, |l| l.dims()[0]);
        let ids = routes.cast(FloatDType::F32);
        let both = match logits {
            Some(logits) => Tensor::cat(vec![logits, ids], 0),
            None => ids,
        };
        let mut values = read_f32(both)?;
        let routes = values[n..].iter().map(|&v| v as i32).collect();
        values.truncate(n);
        return Ok((values, routes));
    }
    let logits = match logits {
        Some(logits) => read_f32(flat(logits))?,
        None => Vec::new(),
    };
    let routes = routes
        .into_data()
        .convert::<i32>()
        .try_into_vec::<i32>()
        .map_err(|e| format!("{e:?}"))?;
    Ok((logits, routes))
}

/// The model the engine's forward steps run for `model`'s weights (sharing them). With the
/// specialised path (`Some(decode)`): q / k / v and gate / up projections fused into one
/// matmul each ([`CausalLm::fuse_projections_with`]: packed panels or the weights read in
/// place, as `decode` says), and on flex MoE layers dispatch sparsely at every batch size.
/// Built anew from every weight version, so no step ever runs on a previous version's
/// weights (or their packed copies).
pub(crate) fn step_model(model: &CausalLm, specialised: Option<DecodeWeights>) -> CausalLm {
    let mut step = model.clone();
    if let Some(decode) = specialised {
        step.fuse_projections_with(decode);
        if miles_ops::device::is_flex(&model.lm_head_weight().device()) {
            step.set_moe_dispatch(MoeDispatch::Sparse);
        }
    }
    step
}

/// While alive, the other threads of the current rayon pool poll for work (running any they
/// can steal, yielding their core to other threads when there is none) instead of going to
/// sleep between the short parallel ops of a decode step: waking a sleeping thread costs a
/// system call and tens of microseconds of scheduler latency per op, during which the
/// stepping thread works alone. A poller gives up after [`KeepAwake::IDLE`] without work, so
/// a step that stalls never keeps a core busy.
pub(crate) struct KeepAwake {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl KeepAwake {
    /// Longest a poller waits for work before it returns its thread to rayon.
    const IDLE: std::time::Duration = std::time::Duration::from_millis(2);

    pub(crate) fn start() -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let owner = rayon::current_thread_index();
        if owner.is_some() {
            for _ in 1..rayon::current_num_threads() {
                let stop = stop.clone();
                rayon::spawn(move || {
                    // The stepping thread itself (popping its own queue) never polls.
                    if rayon::current_thread_index() == owner {
                        return;
                    }
                    let mut idle_since = std::time::Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        match rayon::yield_now() {
                            Some(rayon::Yield::Executed) => idle_since = std::time::Instant::now(),
                            _ if idle_since.elapsed() > Self::IDLE => return,
                            _ => std::thread::yield_now(),
                        }
                    }
                });
            }
        }
        Self { stop }
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
