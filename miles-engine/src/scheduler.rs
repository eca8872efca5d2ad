//! The scheduler thread: commands, admission under the KV budget, continuous batching,
//! weight updates between generations, retirement and answers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use miles_bridge::profile::{self, OpClass};
use miles_bridge::{CausalLm, KvCache, ModelInput, PagedKvCache, RowId};
use miles_core::{
    EngineErrorKind, Error as CoreError, FinishReason, GenerateOutput, MemoryTag, PauseMode,
    RoutedExperts, WeightVersion,
};
use miles_r3::Fallthrough;
use rayon::prelude::*;
use serde_json::Value;
use tokio::sync::oneshot;

use crate::command::{Cmd, Detokenizer, EngineStats, Pending, Released, Shared};
use crate::config::{EngineConfig, KvBudget, StateBudget, available_memory, valid_sampling};
use crate::sampling::sample_token;
use crate::step::{KeepAwake, SequenceScorer, ids_row, read_step, step_model};
use miles_core::rng::SplitMix64;

/// One request inside the scheduler.
pub(crate) struct Seq {
    pub(crate) pending: Pending,
    /// Prompt + output so far.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    pub(crate) max_new: usize,
    pub(crate) log_probs: Vec<f64>,
    /// Routing rows `[positions forwarded, moe layers, top_k]`, flattened.
    pub(crate) routing: Vec<i32>,
    pub(crate) rng: SplitMix64,
    pub(crate) cached_tokens: usize,
    /// Tokens reserved against the KV budget.
    pub(crate) reserved: usize,
    /// Its blocks in the KV pool while it runs.
    pub(crate) row: Option<RowId>,
    /// Version the KV cache of a retracted sequence was computed with.
    pub(crate) retracted_at: Option<u64>,
    /// Already counted as waiting for KV budget.
    pub(crate) waited: bool,
    pub(crate) finish: Option<(FinishReason, Option<Value>)>,
    /// When the engine received the request.
    pub(crate) arrived: Instant,
    /// When the last token was sampled.
    pub(crate) last_token: Option<Instant>,
}

impl Seq {
    pub(crate) fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens whose keys are in the cache (all but the last sampled one).
    pub(crate) fn cached_len(&self) -> usize {
        if self.output_len() == 0 {
            self.tokens.len()
        } else {
            self.tokens.len() - 1
        }
    }
}

/// A fresh sequence admitted with its pool row reserved and its cached prefix looked up
/// (`cache`, `hit` positions), waiting for its prompt forward (`prefill.rs`).
pub(crate) struct Candidate {
    pub(crate) seq: Seq,
    pub(crate) row: RowId,
    pub(crate) cache: KvCache,
    pub(crate) hit: usize,
    /// Positions its prefill leaves cached ([`Scheduler::prefill_target`]).
    pub(crate) target: usize,
}

/// A cached prefix: its tokens, KV cache and routing rows (the prefix cache keeps finished
/// and prefilled sequences for reuse).
pub(crate) struct PrefixEntry {
    pub(crate) tokens: Vec<u32>,
    pub(crate) cache: KvCache,
    pub(crate) routing: Vec<i32>,
    pub(crate) last_used: u64,
}

pub(crate) struct Scheduler {
    /// The current weights (shared with finished sequences still waiting for their answer).
    pub(crate) model: Arc<CausalLm>,
    /// The model the forward steps run: the current weights prepared for the device
    /// ([`super::step::step_model`]), rebuilt with every weight update.
    pub(crate) step: Arc<CausalLm>,
    pub(crate) config: EngineConfig,
    pub(crate) scorer: Arc<dyn SequenceScorer>,
    pub(crate) detokenizer: Option<Arc<dyn Detokenizer>>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) commands: mpsc::Receiver<Cmd>,
    pub(crate) waiting: VecDeque<Seq>,
    pub(crate) running: Vec<Seq>,
    /// The KV cache of the running sequences: pools allocated once from the token budget.
    pub(crate) pool: PagedKvCache,
    pub(crate) paused: Option<PauseMode>,
    pub(crate) updates: VecDeque<(Box<CausalLm>, WeightVersion, oneshot::Sender<()>)>,
    /// A release of memory waiting for generation to stop ([`crate::release`]).
    pub(crate) pending_release: Option<(Vec<MemoryTag>, oneshot::Sender<()>)>,
    /// What is released.
    pub(crate) released: Released,
    /// Finished sequences whose log-probs are still to be recomputed, each with the weights
    /// (and their version) that generated it. They are answered one per scheduler iteration,
    /// so a burst of sequences finishing together never holds a pause or an update for long.
    pub(crate) finished: VecDeque<(Seq, Arc<CausalLm>, WeightVersion)>,
    pub(crate) prefix: Vec<PrefixEntry>,
    pub(crate) clock: u64,
    pub(crate) counter: u64,
    pub(crate) reserved: usize,
    /// Budget positions a hybrid model's state slot is charged as in the prefix cache (0 for
    /// other models); see [`StateBudget`].
    pub(crate) state_tokens: usize,
    pub(crate) route_width: usize,
    pub(crate) stats: EngineStats,
    /// Start of the current `sglang:gen_throughput` window and the tokens generated before it.
    pub(crate) throughput_mark: (Instant, u64),
}

/// The window over which `sglang:gen_throughput` is measured (SGLang logs it per decode log
/// interval; here it is refreshed once a second).
pub(crate) const THROUGHPUT_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);

impl Scheduler {
    pub(crate) fn new(
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
        let step = step_model(&model, config.specialised());
        let mut config = config;
        let per_token = PagedKvCache::bytes_per_token(&step);
        let device = step.lm_head_weight().device();
        let available = miles_ops::device::is_flex(&device)
            .then(available_memory)
            .flatten();
        let budget = KvBudget::resolve(&config, per_token, available)?;
        let requested = config.kv_token_budget;
        config.kv_token_budget = budget.tokens;
        // A hybrid model's linear-attention states take their share of the budget first.
        let state_bytes = PagedKvCache::state_bytes_per_row(&step);
        let states = (state_bytes > 0)
            .then(|| {
                StateBudget::split(
                    budget.tokens,
                    per_token,
                    state_bytes,
                    config.max_running_requests,
                )
            })
            .transpose()?;
        let rows = match states {
            Some(states) => {
                config.kv_token_budget = states.kv_tokens;
                tracing::info!(
                    slots = states.slots,
                    bytes_per_slot = state_bytes,
                    tokens_per_slot = states.tokens_per_slot,
                    "linear-attention state slots: {} (each charged as {} tokens of the KV \
                     budget; {} tokens left for cached positions)",
                    states.slots,
                    states.tokens_per_slot,
                    states.kv_tokens
                );
                states.slots
            }
            None => config.max_running_requests,
        };
        let pool = PagedKvCache::new(&step, config.kv_token_budget, rows)
            .map_err(|e| crate::Error::Config(format!("KV cache: {e}")))?;
        tracing::info!(
            tokens = pool.capacity(),
            mib = pool.bytes() >> 20,
            bytes_per_token = per_token,
            available_mib = available.map(|b| b >> 20),
            kv_memory_fraction = config.kv_memory_fraction,
            "KV pool allocated: {} tokens ({}; + a block per running sequence)",
            config.kv_token_budget,
            if budget.limited_by_memory {
                format!("bounded by kv_memory_fraction, kv_token_budget {requested}")
            } else {
                "kv_token_budget".to_string()
            }
        );
        let mut scheduler = Self {
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
            pending_release: None,
            released: Released::default(),
            finished: VecDeque::new(),
            prefix: Vec::new(),
            clock: 0,
            counter: 0,
            reserved: 0,
            state_tokens: states.map_or(0, |s| s.tokens_per_slot),
            route_width,
            throughput_mark: (Instant::now(), 0),
            stats: EngineStats::default(),
        };
        // The pool's state slots are known before the first request.
        scheduler.publish_stats();
        Ok(scheduler)
    }

    pub(crate) fn version(&self) -> WeightVersion {
        WeightVersion(self.shared.version.load(Ordering::SeqCst))
    }

    pub(crate) fn run(mut self) {
        loop {
            let idle = self.running.is_empty()
                && (self.waiting.is_empty()
                    || self.paused.is_some()
                    || self.released.holds_generation())
                && self.updates.is_empty()
                // A release that waits for the running sequences is applied on the step after
                // the last of them finishes: not idle until then (else it is never answered).
                && self.pending_release.is_none()
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
                self.apply_release();
                if self.paused.is_none()
                    && self.updates.is_empty()
                    && self.pending_release.is_none()
                    && !self.released.holds_generation()
                {
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
        // Shutting down, as if the process died: nothing unanswered is answered any more. Every
        // request still queued, running or waiting for its answer (its log-prob recompute)
        // ends aborted with what it had generated and its decode-time log-probs.
        while let Some((mut seq, model, version)) = self.finished.pop_front() {
            seq.finish = Some((FinishReason::Abort, None));
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

    pub(crate) fn publish_stats(&mut self) {
        self.stats.state_slots = self.pool.state_slots();
        self.stats.free_state_slots = self.pool.free_state_slots();
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
    pub(crate) fn handle(&mut self, cmd: Cmd) -> bool {
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
            Cmd::Release(tags, reply) => self.pending_release = Some((tags, reply)),
            Cmd::ResumeMemory(tags, reply) => self.resume_memory(&tags, reply),
            Cmd::InputLogprobs(_, reply) if self.released.weights => {
                let _ = reply.send(Err(CoreError::engine(
                    EngineErrorKind::Unavailable,
                    "the engine's weights are released while the trainer trains; they come back \
                     with the next weight update",
                )));
            }
            Cmd::InputLogprobs(request, reply) => {
                // Scored between steps on the current weights (an update waits its turn).
                let version = WeightVersion(self.shared.version.load(Ordering::SeqCst));
                let out = crate::input_scoring::input_logprobs(
                    &self.model,
                    &*self.scorer,
                    &request,
                    version,
                );
                let _ = reply.send(out);
            }
            Cmd::Shutdown => return false,
        }
        true
    }

    pub(crate) fn enqueue(&mut self, pending: Pending) {
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
            rng: SplitMix64::new(seed),
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

    pub(crate) fn abort_everything(&mut self) {
        while let Some(seq) = self.waiting.pop_front() {
            self.finish_aborted(seq);
        }
        for seq in &mut self.running {
            seq.finish = Some((FinishReason::Abort, None));
        }
        self.retire_finished();
    }

    /// Releases the KV cache of running sequences and puts them back at the front of the queue.
    pub(crate) fn retract_running(&mut self) {
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

    pub(crate) fn apply_updates(&mut self) {
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
            // Nothing generates now: the previous version (its decode copies, and the weights
            // an optimizer's copy-on-write left to it) goes before the new decode copies are
            // built, so an update never holds two versions' copies at once.
            self.drop_served_weights();
            self.model = Arc::new(*model);
            self.step = Arc::new(step_model(&self.model, self.config.specialised()));
            self.released.weights = false;
            self.publish_released();
            self.shared.version.store(version.0, Ordering::SeqCst);
            let _ = reply.send(());
        }
        self.prefix.clear();
    }

    /// Admits waiting sequences while the running batch and the KV budget allow. Fresh
    /// sequences that need a prompt forward are collected and prefilled together
    /// ([`Self::prefill_candidates`]: prompts of similar lengths in one batched forward); a
    /// fresh prompt equal to one collected in this round (a GRPO group's later members)
    /// stays queued while the round collects the prompts behind it, and is admitted in the
    /// next round, from the first copy's cached prefix.
    pub(crate) fn admit(&mut self) {
        let mut admitted = false;
        loop {
            let mut candidates: Vec<Candidate> = Vec::new();
            // A later copy of a prompt reuses the first copy's cached prefix (all of the
            // prompt but its last token, whole for a hybrid model: `prefill_target`).
            let reuses_prompts = self.config.prefix_cache_tokens > 0;
            // Copies of a collected prompt stay queued (in order, at the front) until the
            // next round, when its prefix is cached.
            let mut skipped = 0;
            while self.running.len() + candidates.len() < self.config.max_running_requests {
                let Some(front) = self.waiting.get(skipped) else {
                    break;
                };
                if reuses_prompts
                    && front.output_len() == 0
                    && candidates.iter().any(|c| c.seq.tokens == front.tokens)
                {
                    skipped += 1;
                    continue;
                }
                let need = front.tokens.len() + front.max_new - front.output_len();
                // The token budget, and blocks for it in the pool (many short sequences can use
                // up the pool's spare blocks for partly filled last blocks first).
                if self.reserved + need > self.config.kv_token_budget
                    || !self.pool.can_reserve(need)
                {
                    if !front.waited {
                        self.stats.budget_waits += 1;
                        if let Some(f) = self.waiting.get_mut(skipped) {
                            f.waited = true;
                        }
                    }
                    break;
                }
                let Some(mut seq) = self.waiting.remove(skipped) else {
                    break;
                };
                // `can_reserve` held above, so this only fails on a broken invariant; the
                // request then fails alone.
                let row = match self.pool.reserve(need) {
                    Ok(row) => row,
                    Err(e) => {
                        let _ = seq.pending.reply.send(Err(CoreError::engine(
                            EngineErrorKind::Internal,
                            format!("prefill failed: {e}"),
                        )));
                        continue;
                    }
                };
                seq.reserved = need;
                self.reserved += need;
                if seq.output_len() == 0 {
                    let (cache, hit) = self.take_prefix(&mut seq);
                    let target = self.prefill_target(&seq);
                    candidates.push(Candidate {
                        seq,
                        row,
                        cache,
                        hit,
                        target,
                    });
                    continue;
                }
                // A retracted sequence: its own forward (no token to sample).
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
                    Err(e) => self.fail_admission(seq, row, e),
                }
            }
            if candidates.is_empty() {
                break;
            }
            self.prefill_candidates(candidates);
            admitted = true;
        }
        if admitted {
            self.stats.max_batch = self.stats.max_batch.max(self.running.len());
        }
        // A sequence may have ended on its first token.
        self.retire_finished();
    }

    /// Fails a sequence whose admission broke (its prefill or the load of its cache),
    /// returning its blocks and budget.
    pub(crate) fn fail_admission(&mut self, seq: Seq, row: RowId, e: String) {
        self.pool.release(row);
        self.reserved -= seq.reserved;
        let _ = seq.pending.reply.send(Err(CoreError::engine(
            EngineErrorKind::Internal,
            format!("prefill failed: {e}"),
        )));
    }

    /// Removes finished sequences from the running batch, returns their blocks and answers
    /// them.
    pub(crate) fn retire_finished(&mut self) {
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

    pub(crate) fn fail_running(&mut self, reason: &str) {
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

    pub(crate) fn finish_aborted(&mut self, mut seq: Seq) {
        self.reserved = self.reserved.saturating_sub(seq.reserved);
        seq.finish = Some((FinishReason::Abort, None));
        let model = self.model.clone();
        self.answer(seq, &model, self.version());
    }

    /// Answers a finished sequence now, or queues it (with the current weights) when its
    /// log-probs must be recomputed first.
    pub(crate) fn finish(&mut self, seq: Seq) {
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
    pub(crate) fn needs_recompute(&self, seq: &Seq) -> bool {
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
    pub(crate) fn answer(&mut self, seq: Seq, model: &CausalLm, version: WeightVersion) {
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

// The prefix cache: KV caches of finished and prefilled sequences kept for reuse.
impl Scheduler {
    /// Longest cached prefix of `tokens` (at most `len − 1` when `keep_one`): the cache, its
    /// length and its routing rows.
    pub(crate) fn lookup_prefix(
        &mut self,
        tokens: &[u32],
        keep_one: bool,
    ) -> (KvCache, usize, Vec<i32>) {
        let limit = if keep_one {
            tokens.len().saturating_sub(1)
        } else {
            tokens.len()
        };
        // A hybrid model's entry holds its linear layers' states after its last token, which
        // cannot be cut back: such an entry is reused whole or not at all.
        let whole_only = self.state_tokens > 0;
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.prefix.iter().enumerate() {
            let common = e
                .tokens
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(limit);
            if whole_only && common < e.tokens.len() {
                continue;
            }
            if common > 0 && best.is_none_or(|(_, c)| common > c) {
                best = Some((i, common));
            }
        }
        let Some((i, common)) = best else {
            return (KvCache::new(), 0, Vec::new());
        };
        self.clock += 1;
        let entry = &mut self.prefix[i];
        entry.last_used = self.clock;
        let cache = if common == entry.tokens.len() {
            entry.cache.clone()
        } else {
            entry.cache.truncate(common)
        };
        let routing =
            entry.routing[..(common * self.route_width).min(entry.routing.len())].to_vec();
        (cache, common, routing)
    }

    pub(crate) fn insert_prefix(&mut self, tokens: Vec<u32>, cache: KvCache, routing: Vec<i32>) {
        let budget = self.config.prefix_cache_tokens;
        // A hybrid model's entry also holds a state slot's worth of budget.
        let cost = |e: &[u32]| e.len() + self.state_tokens;
        if budget == 0 || cost(&tokens) > budget || tokens.is_empty() {
            return;
        }
        if self.state_tokens > 0 {
            // Entries are reused whole only (`lookup_prefix`): a prefix of another entry is
            // not covered by it.
            if self.prefix.iter().any(|e| e.tokens == tokens) {
                return;
            }
        } else {
            // An entry that is a prefix of the new one is covered by it.
            self.prefix
                .retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
            if self.prefix.iter().any(|e| e.tokens.starts_with(&tokens)) {
                return;
            }
        }
        self.clock += 1;
        self.prefix.push(PrefixEntry {
            tokens,
            cache,
            routing,
            last_used: self.clock,
        });
        while self.prefix.iter().map(|e| cost(&e.tokens)).sum::<usize>() > budget {
            let Some(oldest) = self
                .prefix
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.prefix.swap_remove(oldest);
        }
    }
}

// Sampling: the next token of a sequence and the stop conditions.
impl Scheduler {
    /// Samples the next token of `seq` from `logits` and checks the stop conditions.
    pub(crate) fn push_token(&mut self, seq: &mut Seq, logits: &[f32]) {
        let params = &seq.pending.request.sampling_params;
        let (token, lp) = sample_token(logits, params, &mut seq.rng);
        self.accept_token(seq, token, lp);
    }

    /// Appends a sampled `token` (log-prob `lp`) to `seq` and checks the stop conditions.
    pub(crate) fn accept_token(&mut self, seq: &mut Seq, token: u32, lp: f64) {
        let params = &seq.pending.request.sampling_params;
        seq.tokens.push(token);
        seq.log_probs.push(lp);
        self.stats.generated_tokens += 1;
        let now = Instant::now();
        if let Some(metrics) = self.shared.metrics.get() {
            metrics.generation_tokens_total.inc();
            match seq.last_token {
                None => metrics
                    .time_to_first_token_seconds
                    .observe(now.duration_since(seq.arrived).as_secs_f64()),
                Some(last) => metrics
                    .inter_token_latency_seconds
                    .observe(now.duration_since(last).as_secs_f64()),
            }
        }
        seq.last_token = Some(now);
        let produced = seq.output_len();
        let may_stop = produced >= params.min_new_tokens;
        if may_stop
            && (params.stop_token_ids.contains(&token)
                || self.config.eos_token_ids.contains(&token))
        {
            seq.finish = Some((FinishReason::Stop, Some(Value::from(token))));
            return;
        }
        if may_stop
            && !params.stop.is_empty()
            && let Some(detok) = &self.detokenizer
        {
            let text = detok.decode(&seq.tokens[seq.prompt_len..]);
            if let Some(s) = params
                .stop
                .iter()
                .find(|s| !s.is_empty() && text.contains(s.as_str()))
            {
                seq.finish = Some((FinishReason::Stop, Some(Value::from(s.clone()))));
                return;
            }
        }
        if produced >= seq.max_new {
            seq.finish = Some((FinishReason::Length, None));
        }
    }
}

// The model step: prefill and batched decode.
impl Scheduler {
    /// Runs the prompt (or, for a retracted sequence, everything but its last token) through
    /// the model on a fresh one-row cache, reusing the longest cached prefix. A fresh sequence
    /// with all but its last prompt token cached gets no forward here: it joins the running
    /// batch with that token as its next input, and its first token is sampled from the next
    /// decode step.
    pub(crate) fn prefill(&mut self, seq: &mut Seq) -> Result<KvCache, String> {
        let (cache, hit) = self.take_prefix(seq);
        self.prefill_from(seq, cache, hit)
    }

    /// The longest cached prefix of what `seq` must have cached before its next decode step
    /// (its prompt, or for a retracted sequence everything but its last token), with its
    /// length; the prefix's routing rows become `seq`'s and a fresh sequence counts it as
    /// cached prompt tokens.
    pub(crate) fn take_prefix(&mut self, seq: &mut Seq) -> (KvCache, usize) {
        let resumed = seq.output_len() > 0;
        let target = self.prefill_target(seq);
        // A fresh sequence keeps its last prompt token out of a reused prefix (it needs the
        // logits after it), unless its prefill leaves that token out already.
        let keep_one = !resumed && target == seq.tokens.len();
        let (cache, hit, hit_routing) = self.lookup_prefix(&seq.tokens[..target], keep_one);
        if !resumed {
            seq.cached_tokens = hit;
            self.stats.cached_prompt_tokens += hit as u64;
        }
        seq.routing = hit_routing;
        (cache, hit)
    }

    /// Whether a fresh sequence's prefill stops before its last prompt token, which the next
    /// decode step then feeds (sampling the first token from its logits): a hybrid model
    /// with a prefix cache. Its prefix entry is then all of the prompt but that token with
    /// the linear layers' states after it, which a later copy of the prompt (a GRPO group's
    /// other members) reuses whole — a copy of the conv and recurrent states instead of a
    /// prefill of its own — as a model without linear layers reuses any prefix.
    pub(crate) fn defers_last_token(&self) -> bool {
        self.state_tokens > 0 && self.config.prefix_cache_tokens > 0
    }

    /// Positions `seq`'s prefill leaves cached: [`Seq::cached_len`], but for a fresh
    /// sequence of a model that [`Self::defers_last_token`] all of its prompt but the last
    /// token.
    pub(crate) fn prefill_target(&self, seq: &Seq) -> usize {
        if seq.output_len() == 0 && self.defers_last_token() {
            seq.tokens.len().saturating_sub(1)
        } else {
            seq.cached_len()
        }
    }

    /// [`Self::prefill`] after [`Self::take_prefix`] gave `cache` (`hit` positions): the one
    /// sequence's forward over the rest on that cache.
    pub(crate) fn prefill_from(
        &mut self,
        seq: &mut Seq,
        mut cache: KvCache,
        hit: usize,
    ) -> Result<KvCache, String> {
        let resumed = seq.output_len() > 0;
        let target = self.prefill_target(seq);
        // A fresh sequence samples its first token from its prefill's last logits, unless
        // its last prompt token is left to the next decode step.
        let samples = !resumed && target == seq.tokens.len();
        let rest = &seq.tokens[hit..target];
        if rest.is_empty() {
            // A resumed sequence, or a fresh one whose last token is left to the decode step.
            return Ok(cache);
        }
        // A fresh sequence whose whole prompt but its last token is cached (a GRPO group's
        // later members): that token is left to the next batched decode step, which feeds each
        // row its last token, instead of a one-token forward of its own (without linear-
        // attention layers, whose state snapshots are reused whole).
        if !resumed && rest.len() == 1 && self.state_tokens == 0 {
            return Ok(cache);
        }
        let device = self.step.lm_head_weight().device();
        // Hidden states only: the logits of the last position are the only ones used.
        let out = self
            .step
            .forward_cached_hidden(
                &ModelInput::new(ids_row(rest, &device)),
                &mut cache,
                &Fallthrough,
            )
            .map_err(|e| e.to_string())?;
        self.stats.prefill_tokens += rest.len() as u64;
        let routing: &[_] = if self.route_width > 0 {
            &out.routing
        } else {
            &[]
        };
        // The last position's logits (a fresh sequence samples its first token from them)
        // and the routing of every token, in one read.
        let last = samples.then(|| {
            let [_, m, hidden] = out.hidden.dims();
            self.step
                .logits(out.hidden.clone().narrow(1, m - 1, 1).reshape([1, hidden]))
        });
        let (last, routes) = read_step(last, routing)?;
        seq.routing.extend_from_slice(&routes);
        if !resumed {
            self.insert_prefix(
                seq.tokens[..target].to_vec(),
                cache.clone(),
                seq.routing.clone(),
            );
            if samples {
                self.push_token(seq, &last);
            }
        }
        Ok(cache)
    }

    pub(crate) fn decode_step(&mut self) {
        // A decode step is dozens of short parallel ops: the pool's other threads poll for
        // them instead of sleeping between them.
        let _awake = KeepAwake::start();
        let device = self.step.lm_head_weight().device();
        let rows = self.running.len();
        let ids: Vec<i32> = self
            .running
            .iter()
            .map(|s| *s.tokens.last().unwrap_or(&0) as i32)
            .collect();
        let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [rows, 1]), &device);
        let seqs: Vec<_> = self.running.iter().filter_map(|s| s.row).collect();
        let out = match self
            .step
            .forward_paged(input, &mut self.pool, &seqs, &Fallthrough)
        {
            Ok(out) => out,
            Err(e) => {
                self.fail_running(&e.to_string());
                return;
            }
        };
        self.stats.decode_steps += 1;
        let vocab = self.model.config.vocab_size;
        let routing: &[_] = if self.route_width > 0 {
            &out.routing
        } else {
            &[]
        };
        // Logits and routing of the step in one read.
        let (logits, routes) = match profile::time(OpClass::Readback, || {
            read_step(Some(out.logits.reshape([rows, vocab])), routing)
        }) {
            Ok(read) => read,
            Err(e) => {
                self.fail_running(&e);
                return;
            }
        };
        if self.route_width > 0 {
            let width = self.route_width;
            for (seq, row) in self.running.iter_mut().zip(routes.chunks_exact(width)) {
                seq.routing.extend_from_slice(row);
            }
        }
        // Sampling is independent per row (each sequence has its own generator): rows in
        // parallel, then the stop checks in order.
        let mut running = std::mem::take(&mut self.running);
        profile::time(OpClass::Sampling, || {
            let picks: Vec<(u32, f64)> = running
                .par_iter_mut()
                .zip(logits.par_chunks(vocab))
                .map(|(seq, row)| {
                    sample_token(row, &seq.pending.request.sampling_params, &mut seq.rng)
                })
                .collect();
            for (seq, (token, lp)) in running.iter_mut().zip(picks) {
                self.accept_token(seq, token, lp);
            }
        });
        self.running = running;
        self.retire_finished();
    }
}
