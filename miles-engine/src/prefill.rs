//! Batched prefill: the prompts of the sequences admitted together run through the model in
//! as few forwards as their lengths allow, instead of one forward per prompt.
//!
//! A prompt forward over a few dozen tokens is bound by reading the weights (every matmul
//! has a few dozen rows), so `n` prompts prefilled alone read the weights `n` times; one
//! forward over them reads them once. The admitted sequences that need a forward
//! ([`Candidate`]s) are sorted by the length of what is left to prefill after their cached
//! prefix and cut into groups: at most [`MAX_PREFILL_TOKENS`] positions a forward, padding
//! at most half the real tokens. A group of one runs the
//! single-sequence prefill ([`Scheduler::prefill_from`]: a forward on a contiguous cache,
//! exactly as before batching); a larger group loads each member's cached prefix into its
//! pool row and runs one [`CausalLm::forward_paged_hidden`](miles_bridge::CausalLm) over
//! the right-padded rows (padding keys are never attended to and never counted in a row's
//! length), then `lm_head` over each row's last real position only. Every row's values are
//! those of its own prefill up to float rounding (matmuls of more rows may sum in another
//! order); the rollout's log-probs do not depend on them (they are recomputed by the
//! trainer's scorer), and greedy decoding equals HF `generate` as before.
//!
//! A model with linear-attention layers (Qwen3.5) batches prompts of different lengths the
//! same way: each linear layer runs its conv and delta rule row by row over the row's real
//! tokens only ([`GatedDeltaNet::forward_ragged`](miles_bridge::nn::GatedDeltaNet)), each row's
//! delta rule on exactly the inputs its own prefill gives it, so the state slots hold each
//! row's states after its last real token. With a prefix cache such a model prefills all of
//! a fresh prompt but its last token, which the next decode step feeds
//! ([`Scheduler::prefill_target`]): the cached entry is then reusable whole by a later copy
//! of the prompt (a GRPO group's other members start from a copy of its conv and recurrent
//! states instead of a prefill of their own).

use burn::tensor::{Int, Tensor, TensorData};
use miles_bridge::RowId;
use miles_bridge::profile::{self, OpClass};
use miles_r3::Fallthrough;

use crate::scheduler::{Candidate, Scheduler, Seq};
use crate::step::read_step;

/// Most positions (padding included) one batched prefill forward takes.
pub(crate) const MAX_PREFILL_TOKENS: usize = 4096;

/// Positions its prompt forward runs.
fn rest(c: &Candidate) -> usize {
    c.target - c.hit
}

impl Scheduler {
    /// Prefills admitted fresh sequences (module docs) and puts them in the running batch
    /// (a sequence whose prefill fails is answered with the error).
    pub(crate) fn prefill_candidates(&mut self, candidates: Vec<Candidate>) {
        let linear = self.step.config.linear_attention.is_some();
        // A fresh sequence with all of its prompt but the last token cached feeds that token
        // to the next decode step (`prefill_from`): no forward to batch.
        let (mut batchable, single): (Vec<Candidate>, Vec<Candidate>) = candidates
            .into_iter()
            .partition(|c| rest(c) > 1 || (linear && rest(c) == 1));
        for c in single {
            self.prefill_one(c);
        }
        // Longest first: each group's first member sets its padded length.
        batchable.sort_by_key(|c| std::cmp::Reverse(rest(c)));
        let mut group: Vec<Candidate> = Vec::new();
        let mut real = 0;
        for c in batchable {
            let n = rest(&c);
            let fits = group.first().is_none_or(|first| {
                let width = rest(first);
                let padded = width * (group.len() + 1);
                let room = self.pool.row_capacity(c.row) >= c.hit + width;
                padded <= MAX_PREFILL_TOKENS && 2 * padded <= 3 * (real + n) && room
            });
            if !fits {
                self.prefill_group(std::mem::take(&mut group));
                real = 0;
            }
            real += n;
            group.push(c);
        }
        self.prefill_group(group);
    }

    /// The single-sequence prefill of one candidate, then its cache into its pool row.
    fn prefill_one(&mut self, c: Candidate) {
        let Candidate {
            mut seq,
            row,
            cache,
            hit,
            ..
        } = c;
        let loaded = self.prefill_from(&mut seq, cache, hit).and_then(|cache| {
            profile::time(OpClass::KvManage, || self.pool.load(row, &cache))
                .map_err(|e| e.to_string())
        });
        match loaded {
            Ok(()) => {
                seq.row = Some(row);
                self.running.push(seq);
            }
            Err(e) => self.fail_admission(seq, row, e),
        }
    }

    /// One forward over the candidates' prompts (right-padded to the longest), on their pool
    /// rows loaded with their cached prefixes; each samples its first token from its last
    /// position's logits.
    fn prefill_group(&mut self, group: Vec<Candidate>) {
        if group.len() <= 1 {
            for c in group {
                self.prefill_one(c);
            }
            return;
        }
        let mut members: Vec<(Seq, RowId)> = Vec::with_capacity(group.len());
        let mut starts: Vec<usize> = Vec::with_capacity(group.len());
        let mut targets: Vec<usize> = Vec::with_capacity(group.len());
        for c in group {
            let loaded = profile::time(OpClass::KvManage, || self.pool.load(c.row, &c.cache));
            match loaded {
                Ok(()) => {
                    members.push((c.seq, c.row));
                    starts.push(c.hit);
                    targets.push(c.target);
                }
                Err(e) => self.fail_admission(c.seq, c.row, e.to_string()),
            }
        }
        if members.is_empty() {
            return;
        }
        let lens: Vec<usize> = targets
            .iter()
            .zip(&starts)
            .map(|(&target, &hit)| target - hit)
            .collect();
        // Fresh sequences sample their first token from their last position's logits, unless
        // the next decode step feeds their last prompt token (`Scheduler::prefill_target`).
        let samples = !self.defers_last_token();
        let width = lens.iter().copied().max().unwrap_or(1);
        let batch = members.len();
        let mut ids = Vec::with_capacity(batch * width);
        for (((s, _), &hit), &target) in members.iter().zip(&starts).zip(&targets) {
            let rest = &s.tokens[hit..target];
            ids.extend(rest.iter().map(|&t| t as i32));
            ids.extend(std::iter::repeat_n(0, width - rest.len()));
        }
        let device = self.step.lm_head_weight().device();
        let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, width]), &device);
        let rows: Vec<RowId> = members.iter().map(|(_, r)| *r).collect();
        let step = self.step.clone();
        let read = step
            .forward_paged_hidden(input, &mut self.pool, &rows, Some(&lens), &Fallthrough)
            .map_err(|e| e.to_string())
            .and_then(|out| {
                let routing: &[_] = if self.route_width > 0 {
                    &out.routing
                } else {
                    &[]
                };
                if !samples {
                    return read_step(None, routing);
                }
                let [_, m, hidden] = out.hidden.dims();
                let last: Vec<i32> = lens
                    .iter()
                    .enumerate()
                    .map(|(r, &n)| (r * m + n - 1) as i32)
                    .collect();
                let index = Tensor::<1, Int>::from_data(TensorData::new(last, [batch]), &device);
                let last = out.hidden.reshape([batch * m, hidden]).select(0, index);
                read_step(Some(step.logits(last)), routing)
            });
        let (logits, routes) = match read {
            Ok(read) => read,
            Err(e) => {
                for (seq, row) in members {
                    self.fail_admission(seq, row, e.clone());
                }
                return;
            }
        };
        self.stats.prefill_tokens += lens.iter().sum::<usize>() as u64;
        self.stats.max_prefill_batch = self.stats.max_prefill_batch.max(batch);
        let vocab = self.step.config.vocab_size;
        let width_routes = self.route_width;
        for (r, (mut seq, row)) in members.into_iter().enumerate() {
            if width_routes > 0 {
                let from = r * width * width_routes;
                seq.routing
                    .extend_from_slice(&routes[from..from + lens[r] * width_routes]);
            }
            let target = targets[r];
            if self.config.prefix_cache_tokens > 0
                && let Ok(cache) = profile::time(OpClass::KvManage, || self.pool.export(row))
            {
                self.insert_prefix(seq.tokens[..target].to_vec(), cache, seq.routing.clone());
            }
            if samples {
                self.push_token(&mut seq, &logits[r * vocab..(r + 1) * vocab]);
            }
            seq.row = Some(row);
            self.running.push(seq);
        }
    }
}
