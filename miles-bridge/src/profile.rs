//! Opt-in wall-clock profile of the forward pass by op class, for finding where inference
//! time goes (the embedded engine's decode bench prints it).
//!
//! Off unless the environment variable `MILES_PROFILE_OPS` is set to a value other than `0`
//! when it is first read; off, [`time`] is one relaxed atomic load and a call. On, every
//! timed region adds its wall time and one call to its class's process-wide counters
//! ([`snapshot`], [`report`], [`reset`]). Regions are disjoint (never nested), so the classes
//! add up to the timed share of a step.
//!
//! The times are only meaningful on an eager device whose ops finish before they return
//! (flex); on an asynchronous device they measure op submission.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What a timed region computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Token embedding lookup.
    Embed,
    /// RMSNorms of the residual stream (per-head qk-norms count as [`OpClass::Rope`]).
    Norm,
    /// Query / key / value projections (MLA: the query and latent projections).
    QkvProj,
    /// RoPE tables, qk-norm and the rotation of queries and keys, attention masks.
    Rope,
    /// Appending the step's keys / values to the KV cache.
    KvAppend,
    /// The attention itself (scores, softmax, weighted values; MLA: latent expansion or
    /// absorption).
    Attention,
    /// The output projection.
    OProj,
    /// MoE router: logits, scores, group limit, top-k, gate weights.
    Router,
    /// Routed experts (dispatch, projections, combine).
    MoeExperts,
    /// Shared experts of MoE layers.
    SharedExperts,
    /// Dense SwiGLU MLPs.
    DenseMlp,
    /// `lm_head` (logits).
    LmHead,
    /// Reading logits / routing back to the host.
    Readback,
    /// Sampling and stop checks.
    Sampling,
    /// Batch KV-cache bookkeeping between steps (joining, dropping and compacting rows).
    KvManage,
    /// Gated DeltaNet: the causal depthwise conv (and its SiLU) of linear-attention layers.
    LinearConv,
    /// Gated DeltaNet: the delta rule (chunked or recurrent), L2 norms, decay and β.
    DeltaRule,
}

impl OpClass {
    /// Every class, in report order.
    pub const ALL: [OpClass; 17] = [
        OpClass::Embed,
        OpClass::Norm,
        OpClass::QkvProj,
        OpClass::Rope,
        OpClass::KvAppend,
        OpClass::Attention,
        OpClass::OProj,
        OpClass::Router,
        OpClass::MoeExperts,
        OpClass::SharedExperts,
        OpClass::DenseMlp,
        OpClass::LmHead,
        OpClass::Readback,
        OpClass::Sampling,
        OpClass::KvManage,
        OpClass::LinearConv,
        OpClass::DeltaRule,
    ];

    /// Short name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Embed => "embed",
            OpClass::Norm => "norm",
            OpClass::QkvProj => "qkv_proj",
            OpClass::Rope => "rope_qknorm_mask",
            OpClass::KvAppend => "kv_append",
            OpClass::Attention => "attention",
            OpClass::OProj => "o_proj",
            OpClass::Router => "router",
            OpClass::MoeExperts => "moe_experts",
            OpClass::SharedExperts => "shared_experts",
            OpClass::DenseMlp => "dense_mlp",
            OpClass::LmHead => "lm_head",
            OpClass::Readback => "readback",
            OpClass::Sampling => "sampling",
            OpClass::KvManage => "kv_manage",
            OpClass::LinearConv => "linear_conv",
            OpClass::DeltaRule => "delta_rule",
        }
    }

    fn index(self) -> usize {
        OpClass::ALL
            .iter()
            .position(|&c| c == self)
            .unwrap_or_default()
    }
}

const CLASSES: usize = OpClass::ALL.len();

struct Counters {
    nanos: [AtomicU64; CLASSES],
    calls: [AtomicU64; CLASSES],
}

static COUNTERS: Counters = Counters {
    nanos: [const { AtomicU64::new(0) }; CLASSES],
    calls: [const { AtomicU64::new(0) }; CLASSES],
};

/// Whether profiling is on (`MILES_PROFILE_OPS` set and not `0`, read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("MILES_PROFILE_OPS").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// Runs `f`, adding its wall time to `class` when profiling is on.
#[inline]
pub fn time<T>(class: OpClass, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let start = Instant::now();
    let out = f();
    record(class, start.elapsed());
    out
}

/// Adds `elapsed` and one call to `class` (whether or not profiling is on).
pub fn record(class: OpClass, elapsed: Duration) {
    let i = class.index();
    COUNTERS.nanos[i].fetch_add(
        u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
    COUNTERS.calls[i].fetch_add(1, Ordering::Relaxed);
}

/// Zeroes every counter.
pub fn reset() {
    for i in 0..CLASSES {
        COUNTERS.nanos[i].store(0, Ordering::Relaxed);
        COUNTERS.calls[i].store(0, Ordering::Relaxed);
    }
}

/// `(class, total time, calls)` for every class, in [`OpClass::ALL`] order.
pub fn snapshot() -> Vec<(OpClass, Duration, u64)> {
    OpClass::ALL
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            (
                c,
                Duration::from_nanos(COUNTERS.nanos[i].load(Ordering::Relaxed)),
                COUNTERS.calls[i].load(Ordering::Relaxed),
            )
        })
        .collect()
}

/// One line per class with time spent: milliseconds, share of the timed total, calls.
pub fn report() -> String {
    let snap = snapshot();
    let total: f64 = snap.iter().map(|(_, d, _)| d.as_secs_f64()).sum();
    let mut out = format!("timed total {:.1} ms", total * 1e3);
    for (class, d, calls) in snap {
        if calls == 0 {
            continue;
        }
        let secs = d.as_secs_f64();
        out.push_str(&format!(
            "\n  {:<18} {:>9.1} ms {:>5.1}% {:>8} calls",
            class.name(),
            secs * 1e3,
            if total > 0.0 {
                100.0 * secs / total
            } else {
                0.0
            },
            calls
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_adds_time_and_calls_and_reset_clears() {
        // `record` counts whether or not the env var is set, so this runs either way.
        let before = snapshot();
        let idx = OpClass::Sampling.index();
        record(OpClass::Sampling, Duration::from_micros(1500));
        record(OpClass::Sampling, Duration::from_micros(500));
        let after = snapshot();
        assert!(after[idx].1 - before[idx].1 >= Duration::from_micros(2000));
        assert!(after[idx].2 - before[idx].2 >= 2);
        assert!(report().contains("sampling"));
        reset();
        assert_eq!(snapshot()[idx].2, 0);
    }
}
