//! The process-wide switch between the fused ops and their plain-op twins, and which devices
//! the fused ops run on ([`runs_fused`]).
//!
//! Every fused op of this crate (the fused log-probs of [`crate::fused`],
//! [`crate::clipped_pg_loss`], [`crate::attention()`], [`crate::rms_norm`], [`crate::rope`],
//! [`crate::swiglu()`], the grouped matmuls, [`crate::bucket_by_expert`]) asks
//! [`fused_ops_enabled`] (through [`runs_fused`]) before taking its fused path; when it is off, each runs its plain tensor-op form instead (the same
//! values up to float rounding, the full intermediates in memory). It exists to measure the
//! fused ops against the plain path in one process (the `wgpu_step` bench) and to rule the
//! fused ops out when chasing a numerical difference.
//!
//! The setting is read once from `MILES_FUSED_OPS` (`off` / `0` / `false` / `no` turn the
//! fused ops off; unset or anything else leaves them on) at the first query, and
//! [`set_fused_ops`] overrides it from code. It is one value for the whole process, read by
//! every thread: flipping it while other work runs changes which path that work takes, so
//! tests running beside others must not flip it.

use std::sync::atomic::{AtomicU8, Ordering};

/// Environment variable read once at the first [`fused_ops_enabled`] query.
pub const FUSED_OPS_ENV: &str = "MILES_FUSED_OPS";

const UNSET: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;

/// Whether an environment value turns the fused ops off (`off`, `0`, `false`, `no`, any case).
pub fn env_value_turns_off(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "off" | "0" | "false" | "no"
    )
}

/// A switch that starts from the environment on its first query.
#[derive(Debug)]
struct Switch(AtomicU8);

impl Switch {
    const fn new() -> Self {
        Self(AtomicU8::new(UNSET))
    }

    fn enabled_with(&self, env: impl FnOnce() -> Option<String>) -> bool {
        match self.0.load(Ordering::Relaxed) {
            ON => true,
            OFF => false,
            _ => {
                let off = env().is_some_and(|v| env_value_turns_off(&v));
                let state = if off { OFF } else { ON };
                // A concurrent `set` wins over the environment.
                match self
                    .0
                    .compare_exchange(UNSET, state, Ordering::Relaxed, Ordering::Relaxed)
                {
                    Ok(_) => !off,
                    Err(now) => now == ON,
                }
            }
        }
    }

    fn set(&self, enabled: bool) {
        self.0
            .store(if enabled { ON } else { OFF }, Ordering::Relaxed);
    }
}

static SWITCH: Switch = Switch::new();

/// Whether the fused ops run (on the devices that have them). On by default; see the module
/// docs for `MILES_FUSED_OPS` and [`set_fused_ops`].
pub fn fused_ops_enabled() -> bool {
    SWITCH.enabled_with(|| std::env::var(FUSED_OPS_ENV).ok())
}

/// Turns the fused ops on or off for the whole process, overriding `MILES_FUSED_OPS`.
pub fn set_fused_ops(enabled: bool) {
    SWITCH.set(enabled);
}

/// Whether the fused ops take their fused path for tensors on `device`: flex, and the CubeCL
/// devices when the `wgpu` / `cuda` feature is on, with or without autodiff; never while
/// [`fused_ops_enabled`] is off. Elsewhere each op runs its plain-op twin (the fused
/// log-probs fall back to the plain path, same values with the full logits in memory).
pub fn runs_fused(device: &burn::tensor::Device) -> bool {
    if !fused_ops_enabled() {
        return false;
    }
    let inner = device.clone().without_autodiff();
    match inner.as_dispatch() {
        burn::backend::DispatchDevice::Flex(_) => true,
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        burn::backend::DispatchDevice::Cube(_) => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_is_read_once_and_set_overrides_it() {
        let s = Switch::new();
        assert!(!s.enabled_with(|| Some("OFF".into())));
        // Read once: a later environment is not looked at.
        assert!(!s.enabled_with(|| panic!("read twice")));
        s.set(true);
        assert!(s.enabled_with(|| Some("off".into())));
        let s = Switch::new();
        assert!(s.enabled_with(|| None));
        let s = Switch::new();
        assert!(s.enabled_with(|| Some("on".into())));
        let s = Switch::new();
        s.set(false);
        assert!(!s.enabled_with(|| panic!("set before the first query")));
    }

    #[test]
    fn off_spellings() {
        for v in ["off", " 0", "False", "NO"] {
            assert!(env_value_turns_off(v), "{v}");
        }
        for v in ["on", "1", "", "offf"] {
            assert!(!env_value_turns_off(v), "{v}");
        }
    }
}
