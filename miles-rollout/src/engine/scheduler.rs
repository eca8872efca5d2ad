//! The scheduler thread: commands, admission under the KV budget, continuous batching,
//! weight updates between generations, retirement and answers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Instant;

use miles_bridge::profile::{self, OpClass};
use miles_bridge::{CausalLm, PagedKvCache, RowId};
use miles_core::{
    EngineErrorKind, Error as CoreError, FinishReason, GenerateOutput, PauseMode, RoutedExperts,
    WeightVersion,
};
use serde_json::Value;
use tokio::sync::oneshot;

use super::config::valid_sampling;
use super::kv_cache::PrefixEntry;
use super::sampling::Rng;
use super::step::step_model;
use super::{Cmd, Detokenizer, EngineConfig, EngineStats, Pending, SequenceScorer, Shared};

/// One request inside the scheduler.
pub(super) struct Seq {
    pub(super) pending: Pending,
    /// Prompt + output so far.
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    pub(super) max_new: usize,
    pub(super) log_probs: Vec<f64>,
    /// Routing rows `[positions forwarded, moe layers, top_k]`, flattened.
    pub(super) routing: Vec<i32>,
    pub(super) rng: Rng,
    pub(super) cached_tokens: usize,
    /// Tokens reserved against the KV budget.
    pub(super) reserved: usize,
    /// Its blocks in the KV pool while it runs.
    pub(super) row: Option<RowId>,
    /// Version the KV cache of a retracted sequence was computed with.
    pub(super) retracted_at: Option<u64>,
    /// Already counted as waiting for KV budget.
    pub(super) waited: bool,
    pub(super) finish: Option<(FinishReason, Option<Value>)>,
    /// When the engine received the request.
    pub(super) arrived: Instant,
    /// When the last token was sampled.
    pub(super) last_token: Option<Instant>,
}

impl Seq {
    pub(super) fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens whose keys are in the cache (all but the last sampled one).
    pub(super) fn cached_len(&self) -> usize {
        if self.output_len() == 0 {
            self.tokens.len()
        } else {
            self.tokens.len() - 1
        }
    }
}

pub(super) struct Scheduler {
    /// The current weights (shared with finished sequences still waiting for their answer).
    pub(super) model: Arc<CausalLm>,
    /// The model the forward steps run: the current weights prepared for the device
    /// ([`super::step::step_model`]), rebuilt with every weight update.
    pub(super) step: Arc<CausalLm>,
    pub(super) config: EngineConfig,
    pub(super) scorer: Arc<dyn SequenceScorer>,
    pub(super) detokenizer: Option<Arc<dyn Detokenizer>>,
    pub(super) shared: Arc<Shared>,
    pub(super) commands: mpsc::Receiver<Cmd>,
    pub(super) waiting: VecDeque<Seq>,
    pub(super) running: Vec<Seq>,
    /// The KV cache of the running sequences: pools allocated once from the token budget.
    pub(super) pool: PagedKvCache,
    pub(super) paused: Option<PauseMode>,
    pub(super) updates: VecDeque<(Box<CausalLm>, WeightVersion, oneshot::Sender<()>)>,
    /// Finished sequences whose log-probs are still to be recomputed, each with the weights
    /// (and their version) that generated it. They are answered one per scheduler iteration,
    /// so a burst of sequences finishing together never holds a pause or an update for long.
    pub(super) finished: VecDeque<(Seq, Arc<CausalLm>, WeightVersion)>,
    pub(super) prefix: Vec<PrefixEntry>,
    pub(super) clock: u64,
    pub(super) counter: u64,
    pub(super) reserved: usize,
    pub(super) route_width: usize,
    pub(super) stats: EngineStats,
    /// Start of the current `sglang:gen_throughput` window and the tokens generated before it.
    pub(super) throughput_mark: (Instant, u64),
}

/// The window over which `sglang:gen_throughput` is measured (SGLang logs it per decode log
/// interval; here it is refreshed once a second).
pub(super) const THROUGHPUT_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);

impl Scheduler {
    pub(super) fn new(
        model: CausalLm,
        config: EngineConfig,
        scorer: Arc<dyn SequenceScorer>,
        detokenizer: Option<Arc<dyn Detokenizer>>,
        shared: Arc<Shared>,
        commands: mpsc::Receiver<Cmd>,
    ) -> crate::Result<Self> {
        let c = &model.config;
        let moe_layers = (0..c.num_hidden_layers)
            .filter(|&l| c.is_moe_layer(l))
            .count();
        let route_width = moe_layers * c.num_experts_per_tok;
        let step = step_model(&model, config.specialised_path);
        let pool = PagedKvCache::new(&step, config.kv_token_budget, config.max_running_requests)
            .map_err(|e| crate::Error::Config(format!("KV cache: {e}")))?;
        tracing::info!(
            tokens = pool.capacity(),
            mib = pool.bytes() >> 20,
            "KV pool allocated (kv_token_budget {} + a block per running sequence)",
            config.kv_token_budget
        );
        Ok(Self {
            step: Arc::new(step),
            model: Arc::new(model),
            config,
            scorer,
            detokenizer,
            shared,
            commands,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pool,
            paused: None,
            updates: VecDeque::new(),
            finished: VecDeque::new(),
            prefix: Vec::new(),
            clock: 0,
            counter: 0,
            reserved: 0,
            route_width,
            throughput_mark: (Instant::now(), 0),
            stats: EngineStats::default(),
        })
    }

    pub(super) fn version(&self) -> WeightVersion {
        WeightVersion(self.shared.version.load(Ordering::SeqCst))
    }

    pub(super) fn run(mut self) {
        loop {
            let idle = self.running.is_empty()
                && (self.waiting.is_empty() || self.paused.is_some())
                && self.updates.is_empty()
                && self.finished.is_empty();
            let first = if idle {
                match self.commands.recv() {
                    Ok(cmd) => Some(cmd),
                    Err(_) => break,
                }
            } else {
                None
            };
            let mut batch: Vec<Cmd> = first.into_iter().collect();
            batch.extend(self.commands.try_iter());
            if !batch.into_iter().all(|cmd| self.handle(cmd)) {
                break;
            }
            // A panic inside the model (a backend bug, an out-of-memory) fails the requests in
            // flight with a typed error; the engine keeps serving.
            let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if let Some((seq, model, version)) = self.finished.pop_front() {
                    self.answer(seq, &model, version);
                }
                self.apply_updates();
                if self.paused.is_none() && self.updates.is_empty() {
                    self.admit();
                }
                if self.paused.is_none() && !self.running.is_empty() {
                    self.decode_step();
                }
            }));
            if let Err(panic) = step {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                self.fail_running(&format!("engine step failed: {what}"));
                self.reserved = 0;
            }
            self.publish_stats();
        }
        // Shutting down: finished sequences get their answer, everything still queued ends
        // as aborted.
        while let Some((seq, model, version)) = self.finished.pop_front() {
            self.answer(seq, &model, version);
        }
        let rest: Vec<Seq> = self
            .waiting
            .drain(..)
            .chain(self.running.drain(..))
            .collect();
        for seq in rest {
            self.finish_aborted(seq);
        }
        self.shared.alive.store(false, Ordering::SeqCst);
    }

    pub(super) fn publish_stats(&mut self) {
        if let Ok(mut s) = self.shared.stats.lock() {
            *s = self.stats;
        }
        if let Some(metrics) = self.shared.metrics.get() {
            let (since, tokens_then) = self.throughput_mark;
            let elapsed = since.elapsed();
            if elapsed >= THROUGHPUT_WINDOW {
                let tokens = self.stats.generated_tokens;
                metrics
                    .gen_throughput
                    .set(tokens.saturating_sub(tokens_then) as f64 / elapsed.as_secs_f64());
                self.throughput_mark = (Instant::now(), tokens);
            }
            metrics.num_running_reqs.set(self.running.len() as f64);
            metrics.num_queue_reqs.set(self.waiting.len() as f64);
            metrics.num_used_tokens.set(self.reserved as f64);
            metrics
                .token_usage
                .set(self.reserved as f64 / self.config.kv_token_budget.max(1) as f64);
            metrics.weight_version.set(self.version().0 as f64);
        }
    }

    /// Handles one command; `false` to shut down.
    pub(super) fn handle(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Generate(pending) => self.enqueue(*pending),
            Cmd::Abort(rid) => {
                let matches = |s: &Seq| s.pending.request.request_id.as_ref() == Some(&rid);
                if let Some(seq) = self
                    .waiting
                    .iter()
                    .position(matches)
                    .and_then(|i| self.waiting.remove(i))
                {
                    self.finish_aborted(seq);
                }
                if let Some(i) = self.running.iter().position(matches) {
                    self.running[i].finish = Some((FinishReason::Abort, None));
                    self.retire_finished();
                }
            }
            Cmd::AbortAll => self.abort_everything(),
            Cmd::Pause(mode, reply) => {
                match mode {
                    PauseMode::Abort => self.abort_everything(),
                    PauseMode::InPlace => {}
                    PauseMode::Retract => self.retract_running(),
                }
                self.paused = Some(mode);
                let _ = reply.send(());
            }
            Cmd::Resume => self.paused = None,
            Cmd::Flush(reply) => {
                self.prefix.clear();
                let _ = reply.send(());
            }
            Cmd::Update(model, version, reply) => self.updates.push_back((model, version, reply)),
            Cmd::Shutdown => return false,
        }
        true
    }

    pub(super) fn enqueue(&mut self, pending: Pending) {
        let request = &pending.request;
        let params = &request.sampling_params;
        let bad = |reason: String| -> miles_core::Result<GenerateOutput> {
            Err(CoreError::engine(EngineErrorKind::InvalidRequest, reason))
        };
        let vocab = self.model.config.vocab_size;
        let max_new = params
            .max_new_tokens
            .unwrap_or(self.config.default_max_new_tokens);
        let problem = if request.input_ids.is_empty() {
            Some("input_ids is empty".to_string())
        } else if let Some(t) = request.input_ids.iter().find(|&&t| t as usize >= vocab) {
            Some(format!("token id {t} is outside the vocabulary of {vocab}"))
        } else if params.n != 1 {
            Some(format!(
                "n = {} is not supported by one generate call; send n requests",
                params.n
            ))
        } else if !params.stop.is_empty() && self.detokenizer.is_none() {
            Some("stop strings need a tokenizer; this engine has none".to_string())
        } else if !valid_sampling(params) {
            Some("temperature must be ≥ 0, top_p in (0, 1], min_p in [0, 1]".to_string())
        } else if request.input_ids.len() >= self.model.config.max_position_embeddings {
            Some(format!(
                "prompt of {} tokens does not fit the context of {}",
                request.input_ids.len(),
                self.model.config.max_position_embeddings
            ))
        } else if request.input_ids.len().saturating_add(max_new) > self.config.kv_token_budget {
            Some(format!(
                "prompt ({} tokens) + max_new_tokens ({max_new}) exceeds the KV budget of {} \
                 tokens: this request could never be admitted",
                request.input_ids.len(),
                self.config.kv_token_budget
            ))
        } else {
            None
        };
        if let Some(reason) = problem {
            let _ = pending.reply.send(bad(reason));
            return;
        }
        self.counter += 1;
        let seed = params.sampling_seed.unwrap_or_else(|| {
            self.config
                .seed
                .wrapping_mul(0x9E37_79B9)
                .wrapping_add(self.counter)
        });
        let tokens = request.input_ids.clone();
        let prompt_len = tokens.len();
        let max_new = max_new.min(self.model.config.max_position_embeddings - prompt_len);
        self.waiting.push_back(Seq {
            pending,
            tokens,
            prompt_len,
            max_new,
            log_probs: Vec::new(),
            routing: Vec::new(),
            rng: Rng(seed),
            cached_tokens: 0,
            row: None,
            reserved: 0,
            retracted_at: None,
            waited: false,
            finish: None,
            arrived: Instant::now(),
            last_token: None,
        });
        if let Some(metrics) = self.shared.metrics.get() {
            metrics.prompt_tokens_total.inc_by(prompt_len as f64);
        }
    }

    pub(super) fn abort_everything(&mut self) {
        while let Some(seq) = self.waiting.pop_front() {
            self.finish_aborted(seq);
        }
        for seq in &mut self.running {
            seq.finish = Some((FinishReason::Abort, None));
        }
        self.retire_finished();
    }

    /// Releases the KV cache of running sequences and puts them back at the front of the queue.
    pub(super) fn retract_running(&mut self) {
        let version = self.version().0;
        let running: Vec<Seq> = self.running.drain(..).collect();
        for mut seq in running.into_iter().rev() {
            if let Some(row) = seq.row.take() {
                self.pool.release(row);
            }
            self.reserved -= seq.reserved;
            seq.reserved = 0;
            seq.retracted_at = Some(version);
            self.waiting.push_front(seq);
        }
    }

    pub(super) fn apply_updates(&mut self) {
        if self.updates.is_empty() {
            return;
        }
        if self.paused.is_some() {
            // Held sequences cannot continue on new weights without mixing versions.
            for seq in &mut self.running {
                seq.finish = Some((FinishReason::Abort, None));
            }
            self.retire_finished();
        }
        if !self.running.is_empty() {
            return; // wait until no sequence is mid-generation
        }
        let current = self.version().0;
        let stale: Vec<usize> = self
            .waiting
            .iter()
            .enumerate()
            .filter(|(_, s)| s.retracted_at.is_some_and(|v| v == current))
            .map(|(i, _)| i)
            .collect();
        for i in stale.into_iter().rev() {
            if let Some(seq) = self.waiting.remove(i) {
                self.finish_aborted(seq);
            }
        }
        while let Some((model, version, reply)) = self.updates.pop_front() {
            self.model = Arc::new(*model);
            self.step = Arc::new(step_model(&self.model, self.config.specialised_path));
            self.shared.version.store(version.0, Ordering::SeqCst);
            let _ = reply.send(());
        }
        self.prefix.clear();
    }

    pub(super) fn admit(&mut self) {
        let mut admitted = false;
        while self.running.len() < self.config.max_running_requests {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let need = front.tokens.len() + front.max_new - front.output_len();
            // The token budget, and blocks for it in the pool (many short sequences can use
            // up the pool's spare blocks for partly filled last blocks first).
            if self.reserved + need > self.config.kv_token_budget || !self.pool.can_reserve(need) {
                if !front.waited {
                    self.stats.budget_waits += 1;
                    if let Some(f) = self.waiting.front_mut() {
                        f.waited = true;
                    }
                }
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            let fail = |seq: Seq, e: String| {
                let _ = seq.pending.reply.send(Err(CoreError::engine(
                    EngineErrorKind::Internal,
                    format!("prefill failed: {e}"),
                )));
            };
            // `can_reserve` held above, so this only fails on a broken invariant; the request
            // then fails alone.
            let row = match self.pool.reserve(need) {
                Ok(row) => row,
                Err(e) => {
                    fail(seq, e.to_string());
                    continue;
                }
            };
            seq.reserved = need;
            self.reserved += need;
            let loaded = self.prefill(&mut seq).and_then(|cache| {
                profile::time(OpClass::KvManage, || self.pool.load(row, &cache))
                    .map_err(|e| e.to_string())
            });
            match loaded {
                Ok(()) => {
                    seq.row = Some(row);
                    self.running.push(seq);
                    admitted = true;
                }
                Err(e) => {
                    self.pool.release(row);
                    self.reserved -= need;
                    fail(seq, e);
                }
            }
        }
        if admitted {
            self.stats.max_batch = self.stats.max_batch.max(self.running.len());
        }
        // A sequence may have ended on its first token.
        self.retire_finished();
    }

    /// Removes finished sequences from the running batch, returns their blocks and answers
    /// them.
    pub(super) fn retire_finished(&mut self) {
        if self.running.iter().all(|s| s.finish.is_none()) {
            return;
        }
        let (done, running): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| s.finish.is_some());
        self.running = running;
        for mut seq in done {
            if let Some(row) = seq.row.take() {
                // Finished sequences' caches go to the prefix cache (multi-turn reuse).
                if self.config.prefix_cache_tokens > 0
                    && seq
                        .finish
                        .as_ref()
                        .is_some_and(|f| f.0 != FinishReason::Abort)
                    && let Ok(one) = profile::time(OpClass::KvManage, || self.pool.export(row))
                    && one.len() == seq.cached_len()
                {
                    let cached = seq.cached_len();
                    let tokens = seq.tokens[..cached].to_vec();
                    let routing =
                        seq.routing[..(cached * self.route_width).min(seq.routing.len())].to_vec();
                    self.insert_prefix(tokens, one, routing);
                }
                self.pool.release(row);
            }
            self.reserved -= seq.reserved;
            self.finish(seq);
        }
    }

    pub(super) fn fail_running(&mut self, reason: &str) {
        let running: Vec<Seq> = self.running.drain(..).collect();
        for mut seq in running {
            if let Some(row) = seq.row.take() {
                self.pool.release(row);
            }
            self.reserved = self.reserved.saturating_sub(seq.reserved);
            let _ = seq.pending.reply.send(Err(CoreError::engine(
                EngineErrorKind::Internal,
                reason.to_string(),
            )));
        }
    }

    pub(super) fn finish_aborted(&mut self, mut seq: Seq) {
        self.reserved = self.reserved.saturating_sub(seq.reserved);
        seq.finish = Some((FinishReason::Abort, None));
        let model = self.model.clone();
        self.answer(seq, &model, self.version());
    }

    /// Answers a finished sequence now, or queues it (with the current weights) when its
    /// log-probs must be recomputed first.
    pub(super) fn finish(&mut self, seq: Seq) {
        let model = self.model.clone();
        let version = self.version();
        if self.needs_recompute(&seq) {
            self.finished.push_back((seq, model, version));
        } else {
            self.answer(seq, &model, version);
        }
    }

    /// Whether the sequence's log-probs are recomputed by the scorer: a stop or length finish
    /// with generated tokens, when asked for (aborted outputs keep their decode log-probs).
    pub(super) fn needs_recompute(&self, seq: &Seq) -> bool {
        self.config.recompute_logprobs_via_prefill
            && seq.pending.request.return_logprob
            && seq
                .finish
                .as_ref()
                .is_some_and(|f| f.0 != FinishReason::Abort)
            && seq.tokens.len() > seq.prompt_len
    }

    /// Builds the output of a finished sequence and sends it; `model` holds the weights that
    /// generated it (for the log-prob recompute) and `version` their version.
    pub(super) fn answer(&mut self, seq: Seq, model: &CausalLm, version: WeightVersion) {
        let recompute = self.needs_recompute(&seq);
        if let Some(metrics) = self.shared.metrics.get() {
            metrics.num_requests_total.inc();
            if matches!(seq.finish, None | Some((FinishReason::Abort, _))) {
                metrics.num_aborted_requests_total.inc();
            }
            metrics
                .e2e_request_latency_seconds
                .observe(seq.arrived.elapsed().as_secs_f64());
        }
        let Seq {
            pending,
            tokens,
            prompt_len,
            mut log_probs,
            routing,
            cached_tokens,
            finish,
            ..
        } = seq;
        let request = &pending.request;
        let (finish_reason, matched_stop) = finish.unwrap_or((FinishReason::Abort, None));
        let output_ids = tokens[prompt_len..].to_vec();
        if recompute {
            match self.scorer.score(model, &tokens, output_ids.len()) {
                Ok(lp) if lp.len() == output_ids.len() => {
                    log_probs = lp.into_iter().map(f64::from).collect();
                }
                Ok(lp) => {
                    let _ = pending.reply.send(Err(CoreError::engine(
                        EngineErrorKind::Internal,
                        format!(
                            "scorer returned {} log-probs for {} tokens",
                            lp.len(),
                            output_ids.len()
                        ),
                    )));
                    return;
                }
                Err(e) => {
                    let _ = pending.reply.send(Err(CoreError::engine(
                        EngineErrorKind::Internal,
                        format!("log-prob recompute failed: {e}"),
                    )));
                    return;
                }
            }
        }
        let routed_experts = if request.return_routed_experts && self.route_width > 0 {
            // SGLang's wire form: every hidden layer, dense layers' rows zero.
            let c = &self.model.config;
            let k = c.num_experts_per_tok;
            let layers = c.num_hidden_layers;
            // A sequence aborted before (or during) prefill has fewer routed rows than
            // tokens: report the rows it has.
            let rows = tokens
                .len()
                .saturating_sub(1)
                .min(routing.len() / self.route_width);
            let start = request.routed_experts_start_len.unwrap_or(0).min(rows);
            let mut data = Vec::with_capacity((rows - start) * layers * k);
            for row in start..rows {
                let mut moe =
                    routing[row * self.route_width..(row + 1) * self.route_width].chunks_exact(k);
                for layer in 0..layers {
                    match c.is_moe_layer(layer).then(|| moe.next()).flatten() {
                        Some(chosen) => data.extend_from_slice(chosen),
                        None => data.extend(std::iter::repeat_n(0, k)),
                    }
                }
            }
            RoutedExperts::new(rows - start, layers, k, data).ok()
        } else {
            None
        };
        let output = GenerateOutput {
            request_id: request.request_id.clone(),
            output_log_probs: if request.return_logprob {
                log_probs
            } else {
                Vec::new()
            },
            output_ids,
            routed_experts,
            finish_reason,
            matched_stop,
            weight_version: version,
            prompt_tokens: prompt_len,
            cached_tokens,
        };
        let _ = pending.reply.send(Ok(output));
    }
}
