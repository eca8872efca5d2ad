//! Fused vs plain log-probs + entropy (forward + backward): wall time and peak heap memory,
//! and the time of one full policy-loss step. Prints one table.
//!
//! A plain harness (not criterion): peak memory needs a counting global allocator, and the
//! large cases run once. Run on flex, f32:
//!
//! ```text
//! cargo test -p miles-ops --bench fused_logprobs            # dev profile (deps at opt 3)
//! MILES_BENCH_FULL=1 cargo test -p miles-ops --bench fused_logprobs   # the issue's sizes
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Device, Distribution, Int, Tensor};
use miles_ops::fused::FusedLogProbConfig;
use miles_ops::policy::{PolicyLossConfig, PolicyLossInput};

struct Counting;
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: forwards every call to `System` unchanged and only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f`, returning (seconds, peak bytes above the level at the start).
fn measure(f: impl FnOnce()) -> (f64, usize) {
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let start = Instant::now();
    f();
    let secs = start.elapsed().as_secs_f64();
    (secs, PEAK.load(Ordering::Relaxed) - base)
}

fn inputs(tokens: usize, hidden: usize, vocab: usize) -> (Tensor<2>, Tensor<2>, Tensor<1, Int>) {
    let d = Device::flex();
    let h = Tensor::<2>::random([tokens, hidden], Distribution::Normal(0.0, 1.0), &d);
    let w = Tensor::<2>::random([vocab, hidden], Distribution::Normal(0.0, 0.02), &d);
    let y = Tensor::<1, Int>::random([tokens], Distribution::Uniform(0.0, vocab as f64), &d);
    (h, w, y)
}

fn step(h: &Tensor<2>, w: &Tensor<2>, y: &Tensor<1, Int>, fused: bool) {
    let h = h.clone().autodiff().require_grad();
    let w = w.clone().autodiff().require_grad();
    let y = y.clone();
    let (lp, ent) = if fused {
        FusedLogProbConfig::default()
            .forward(h.clone(), w.clone(), y)
            .expect("valid input")
    } else {
        let [n, _] = h.dims();
        let logits = h.clone().matmul(w.clone().transpose());
        let lp = log_softmax(logits.clone(), 1)
            .gather(1, y.reshape([n, 1]))
            .reshape([n]);
        let ent = (softmax(logits.clone(), 1) * log_softmax(logits, 1))
            .sum_dim(1)
            .neg()
            .reshape([n]);
        (lp, ent)
    };
    let grads = (lp.sum() + ent.sum()).backward();
    let gh = h.grad(&grads).expect("grad");
    let gw = w.grad(&grads).expect("grad");
    // Force both gradients to exist on the host side of the measurement.
    let _ = (gh.sum().into_scalar::<f32>(), gw.sum().into_scalar::<f32>());
}

fn loss_step(batch: usize, tokens: usize) {
    let d = Device::flex();
    let r = |scale: f64| Tensor::<2>::random([batch, tokens], Distribution::Normal(0.0, scale), &d);
    let lp = (r(0.1) - 1.0).autodiff().require_grad();
    let input = PolicyLossInput::new(
        lp.clone(),
        (r(0.1) - 1.0).autodiff(),
        r(1.0).autodiff(),
        Tensor::<2>::ones([batch, tokens], &d).autodiff(),
    )
    .with_rollout_log_probs((r(0.1) - 1.0).autodiff())
    .with_ref_log_probs((r(0.1) - 1.0).autodiff())
    .with_entropy(r(1.0).abs().autodiff());
    let loss = PolicyLossConfig {
        eps_clip_high: Some(0.28),
        eps_clip_c: Some(3.0),
        use_tis: true,
        use_kl_loss: true,
        kl_loss_coef: 0.01,
        kl_loss_type: miles_ops::kl::KlLossType::LowVarKl,
        entropy_coef: 0.001,
        use_opsm: true,
        ..Default::default()
    }
    .init()
    .expect("valid config");
    let out = loss.forward(input).expect("valid input");
    let grads = out.loss.backward();
    let _ = lp.grad(&grads).expect("grad").sum().into_scalar::<f32>();
}

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn main() {
    let full = std::env::var("MILES_BENCH_FULL").is_ok_and(|v| v == "1");
    // (tokens, hidden, vocab, run the plain path too)
    let cases: Vec<(usize, usize, usize, bool)> = if full {
        vec![
            (4096, 512, 32_000, true),
            (1024, 512, 151_936, true),
            (4096, 512, 151_936, false),
        ]
    } else {
        vec![(512, 128, 8_000, true)]
    };
    println!(
        "| tokens × hidden × vocab | path | fwd+bwd s | peak MiB | plain/fused peak | fused/plain time |"
    );
    println!("|---|---|---|---|---|---|");
    for (t, h, v, with_plain) in cases {
        let (hs, ws, ys) = inputs(t, h, v);
        let plain = with_plain.then(|| measure(|| step(&hs, &ws, &ys, false)));
        let fused = measure(|| step(&hs, &ws, &ys, true));
        if let Some((ps, pm)) = plain {
            println!("| {t} × {h} × {v} | plain | {ps:.2} | {:.0} | | |", mib(pm));
            println!(
                "| {t} × {h} × {v} | fused | {:.2} | {:.0} | {:.1}× | {:.2} |",
                fused.0,
                mib(fused.1),
                pm as f64 / fused.1.max(1) as f64,
                fused.0 / ps
            );
        } else {
            println!(
                "| {t} × {h} × {v} | fused | {:.2} | {:.0} | (plain not run) | |",
                fused.0,
                mib(fused.1)
            );
        }
    }
    let (b, n) = if full { (64, 2048) } else { (8, 256) };
    let (s, m) = measure(|| loss_step(b, n));
    println!(
        "| loss step {b} × {n} (all terms, fwd+bwd) | — | {s:.3} | {:.0} | | |",
        mib(m)
    );
}
