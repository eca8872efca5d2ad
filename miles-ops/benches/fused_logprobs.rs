//! Fused vs plain log-probs + entropy (forward + backward) on flex, f32: criterion wall time
//! and peak heap memory (a counting global allocator), for tokens × hidden × vocab =
//! 4,096 × 512 × 32,000 and 4,096 × 512 × 151,936; and the time of one full policy-loss step
//! (all terms) over 64 × 2,048 tokens.
//!
//! Each group's `baseline` is the plain `lm_head → log_softmax → gather` path; targets (printed
//! as `xtask-result:` lines for `cargo xtask bench`): fused time ≤ 1.0× the baseline, and peak
//! memory fused / plain ≤ 0.25 (plain / fused ≥ 4; also printed as `peak-memory:` lines).
//! The plain path runs only when `MemAvailable` leaves room for its estimated need: the bytes
//! per logit measured on the smaller vocabulary's plain run (24 before any measurement) ×
//! the logits × 1.25. At the Qwen vocabulary that is ~23.7 GiB (32 bytes per logit measured on
//! flex), more than these 24 GiB machines have free, so the row records the fused side only
//! and says what the plain side would need.
//!
//! With the `wgpu` feature, the same comparison also runs on the kernel device (CubeCL kernels
//! on wgpu; lavapipe without a GPU) at 1,024 × 128 × 32,000 (the issue's 8:1 tokens : hidden) (`MILES_BENCH_WGPU_TOKENS` /
//! `MILES_BENCH_WGPU_HIDDEN` change the sizes), with device memory read from the allocator.
//! `MILES_BENCH_TOKENS` changes the token count of the flex comparison, `MILES_BENCH_VOCABS`
//! (comma-separated) its vocabularies. Sizes above 300 M logits (the Qwen vocabulary) are timed
//! as the best of `MILES_BENCH_ONESHOT_RUNS` (default 2) single runs: one plain step takes minutes.
//!
//! ```text
//! cargo bench -p miles-ops --bench fused_logprobs                 # the issue's sizes
//! MILES_BENCH_SMALL=1 cargo bench -p miles-ops --bench fused_logprobs   # quick smoke run
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Device, Distribution, Int, Tensor};
use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use miles_ops::fused::FusedLogProbConfig;
use miles_ops::{PolicyLossConfig, PolicyLossInput};

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

fn inputs(
    d: &Device,
    tokens: usize,
    hidden: usize,
    vocab: usize,
) -> (Tensor<2>, Tensor<2>, Tensor<1, Int>) {
    let d = d.clone();
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

/// Inputs of the loss step: (new, old, advantages, rollout, ref log-probs, entropy).
fn loss_inputs(batch: usize, tokens: usize) -> [Tensor<2>; 6] {
    let d = Device::flex();
    let r = |scale: f64| Tensor::<2>::random([batch, tokens], Distribution::Normal(0.0, scale), &d);
    [
        r(0.1) - 1.0,
        r(0.1) - 1.0,
        r(1.0),
        r(0.1) - 1.0,
        r(0.1) - 1.0,
        r(1.0).abs(),
    ]
}

/// One policy-loss step with every term on (PPO clip with asymmetric and dual clip, TIS,
/// low-var KL loss, entropy bonus, OPSM), forward + backward to the log-probs.
fn loss_step(inputs: &[Tensor<2>; 6]) {
    let [new, old, adv, rollout, reference, entropy] = inputs.clone();
    let [b, t] = new.dims();
    let lp = new.autodiff().require_grad();
    let input = PolicyLossInput::new(
        lp.clone(),
        old.autodiff(),
        adv.autodiff(),
        Tensor::<2>::ones([b, t], &Device::flex()).autodiff(),
    )
    .with_rollout_log_probs(rollout.autodiff())
    .with_ref_log_probs(reference.autodiff())
    .with_entropy(entropy.autodiff());
    let loss = PolicyLossConfig {
        eps_clip_high: Some(0.28),
        eps_clip_c: Some(3.0),
        use_tis: true,
        use_kl_loss: true,
        kl_loss_coef: 0.01,
        kl_loss_type: miles_ops::KlLossType::LowVarKl,
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

/// `MemAvailable` from /proc/meminfo, in bytes (None off Linux).
fn mem_available() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn small() -> bool {
    std::env::var("MILES_BENCH_SMALL").is_ok_and(|v| v == "1")
}

/// A positive integer from the environment, or `default`.
fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&v| v > 0)
        .unwrap_or(default)
}

/// Times one fwd+bwd per iteration and returns the largest peak seen.
fn bench_step(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    (h, w, y): &(Tensor<2>, Tensor<2>, Tensor<1, Int>),
    fused: bool,
) -> usize {
    let mut peak = 0usize;
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (secs, bytes) = measure(|| step(h, w, y, fused));
                total += Duration::from_secs_f64(secs);
                peak = peak.max(bytes);
            }
            total
        })
    });
    peak
}

fn fused_vs_plain(c: &mut Criterion) {
    let (tokens, hidden) = if small() { (512, 128) } else { (4096, 512) };
    let tokens = env_usize("MILES_BENCH_TOKENS", tokens);
    let vocabs: Vec<usize> = match std::env::var("MILES_BENCH_VOCABS") {
        Ok(list) => list
            .split(',')
            .filter_map(|v| v.trim().parse().ok())
            .collect(),
        Err(_) if small() => vec![8_000],
        Err(_) => vec![32_000, 151_936],
    };
    let mut plain_bytes_per_logit = None;
    for &vocab in &vocabs {
        let id = format!("fused_logprobs_{tokens}x{hidden}x{vocab}");
        let inputs = inputs(&Device::flex(), tokens, hidden, vocab);
        let mut group = c.benchmark_group(&id);
        group
            .sample_size(10)
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_millis(1))
            .measurement_time(Duration::from_secs(1));
        // Room for the plain path: its peak per logit measured on the first size, ×1.25.
        let logits = tokens * vocab;
        // Before any measurement, assume six live f32 copies of the logits.
        let per_logit: f64 = plain_bytes_per_logit.unwrap_or(24.0);
        let need = (per_logit * logits as f64 * 1.25) as usize;
        let plain_fits = mem_available().is_none_or(|avail| need < avail);
        // Above ~300 M logits one plain step takes minutes: time single runs (best of
        // MILES_BENCH_ONESHOT_RUNS, default 2) instead of criterion's ten samples.
        let oneshot = logits > 300_000_000;
        // `ours=` / `baseline=` of the time row: criterion references, or seconds.
        let (plain_peak, fused_peak, ours, baseline, how) = if oneshot {
            group.finish();
            let runs = env_usize("MILES_BENCH_ONESHOT_RUNS", 2);
            let best = |fused: bool| {
                (0..runs)
                    .map(|_| measure(|| step(&inputs.0, &inputs.1, &inputs.2, fused)))
                    .fold((f64::INFINITY, 0usize), |(t, p), (s, b)| {
                        (t.min(s), p.max(b))
                    })
            };
            let plain = plain_fits.then(|| best(false));
            let (fused_secs, fused_peak) = best(true);
            let plain_secs = plain.map_or("not run".to_string(), |p| format!("{:.3}s", p.0));
            println!("# {id}: fused {fused_secs:.3}s, plain {plain_secs}");
            let ours = format!("{fused_secs:.3}s");
            (
                plain.map(|p| p.1),
                fused_peak,
                ours,
                plain_secs,
                ", best of single runs",
            )
        } else {
            let plain_peak = plain_fits.then(|| bench_step(&mut group, "baseline", &inputs, false));
            let fused_peak = bench_step(&mut group, "fused", &inputs, true);
            group.finish();
            let (ours, baseline) = (format!("@{id}/fused"), format!("@{id}/baseline"));
            (plain_peak, fused_peak, ours, baseline, "")
        };
        if fused_peak == 0 {
            continue; // filtered out on the command line
        }
        if let Some(p) = plain_peak {
            plain_bytes_per_logit.get_or_insert(p as f64 / logits as f64);
            println!(
                "xtask-result: {id} ours={ours} baseline={baseline} target=<=1.0 \
                 note=fused vs plain log-probs + entropy, fwd+bwd, flex f32{how}"
            );
            println!(
                "xtask-result: {id}_peak_memory ours={:.1}MiB baseline={:.1}MiB target=<=0.25 \
                 note=peak heap, fused vs plain (plain / fused >= 4)",
                mib(fused_peak),
                mib(p)
            );
            println!(
                "peak-memory: {id} plain {:.0} MiB, fused {:.0} MiB, plain/fused {:.2}x (target >= 4x: {})",
                mib(p),
                mib(fused_peak),
                p as f64 / fused_peak.max(1) as f64,
                if p >= 4 * fused_peak {
                    "met"
                } else {
                    "NOT met"
                }
            );
        } else {
            println!(
                "xtask-result: {id} ours={ours} target=<=1.0 \
                 note=plain path not run: it needs ~{:.0} MiB{how}",
                mib(need)
            );
            println!(
                "xtask-result: {id}_peak_memory ours={:.1}MiB target=<=0.25 \
                 note=plain path not run: it needs ~{:.0} MiB",
                mib(fused_peak),
                mib(need)
            );
            println!(
                "peak-memory: {id} plain not run (needs ~{:.0} MiB, MemAvailable {:.0} MiB), fused {:.0} MiB",
                mib(need),
                mib(mem_available().unwrap_or(0)),
                mib(fused_peak)
            );
        }
    }
}

fn policy_loss_step(c: &mut Criterion) {
    let (b, n) = if small() { (8, 256) } else { (64, 2048) };
    let mut group = c.benchmark_group(format!("loss_step_{b}x{n}"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(3));
    let inputs = loss_inputs(b, n);
    let mut peak = 0usize;
    group.bench_function("all_terms", |bch| {
        bch.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (secs, bytes) = measure(|| loss_step(&inputs));
                total += Duration::from_secs_f64(secs);
                peak = peak.max(bytes);
            }
            total
        })
    });
    group.finish();
    if peak == 0 {
        return; // filtered out on the command line
    }
    println!("peak-memory: loss_step_{b}x{n} {:.0} MiB", mib(peak));
    println!(
        "xtask-result: loss_step_{b}x{n} ours=@loss_step_{b}x{n}/all_terms \
         note=one policy-loss step (all terms), {:.0} MiB peak heap, no baseline",
        mib(peak)
    );
}

/// Fused (CubeCL kernels) vs plain on the kernel device (wgpu; lavapipe without a GPU): time,
/// and device memory as the allocator's reserved bytes after one step that started from a
/// cleaned pool (pools keep their pages until the next cleanup, so this is the step's
/// high-water reservation). Small sizes by default: lavapipe runs on the same 2 CPU cores.
#[cfg(feature = "wgpu")]
fn fused_vs_plain_wgpu(c: &mut Criterion) {
    let Some(device) = miles_ops::kernels::kernel_test_device("fused_vs_plain_wgpu") else {
        return;
    };
    let tokens = env_usize("MILES_BENCH_WGPU_TOKENS", 1024);
    let hidden = env_usize("MILES_BENCH_WGPU_HIDDEN", 128);
    let vocabs: &[usize] = if small() { &[8_000] } else { &[32_000] };
    for &vocab in vocabs {
        let id = format!("fused_logprobs_wgpu_{tokens}x{hidden}x{vocab}");
        let inputs = inputs(&device, tokens, hidden, vocab);
        let reserved = |fused: bool| {
            device.memory_cleanup();
            let base = device.memory_pool_usage().map_or(0, |u| u.bytes_reserved);
            step(&inputs.0, &inputs.1, &inputs.2, fused);
            let after = device.memory_pool_usage().map_or(0, |u| u.bytes_reserved);
            after.saturating_sub(base) as usize
        };
        // One untimed step each first: shader compilation and autotune stay out of the numbers.
        let (plain_mem, fused_mem) = (reserved(false), reserved(true));
        let mut group = c.benchmark_group(&id);
        group
            .sample_size(10)
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_millis(1))
            .measurement_time(Duration::from_secs(1));
        for (name, fused) in [("baseline", false), ("fused", true)] {
            group.bench_function(name, |b| {
                b.iter(|| step(&inputs.0, &inputs.1, &inputs.2, fused))
            });
        }
        group.finish();
        println!("xtask-target: {id}/fused <= 1.0");
        println!(
            "peak-memory: {id} (device reserved) plain {:.0} MiB, fused {:.0} MiB, plain/fused {:.2}x (target >= 4x: {})",
            mib(plain_mem),
            mib(fused_mem),
            plain_mem as f64 / fused_mem.max(1) as f64,
            if plain_mem >= 4 * fused_mem {
                "met"
            } else {
                "NOT met"
            }
        );
    }
}

#[cfg(not(feature = "wgpu"))]
fn fused_vs_plain_wgpu(_: &mut Criterion) {}

criterion_group!(
    benches,
    fused_vs_plain,
    fused_vs_plain_wgpu,
    policy_loss_step
);
criterion_main!(benches);
