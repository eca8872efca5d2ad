//! The device CubeCL kernels are tested on, and the policy for machines without one.
//!
//! Kernel tests run on the wgpu runtime over whatever adapter exists. On a machine without a
//! GPU that is Mesa's software Vulkan driver (lavapipe ≥ 25, Debian bookworm-backports
//! `mesa-vulkan-drivers libvulkan1`), reached with `DeviceKind::Cpu`. Each kernel is compared
//! with its plain-op `*_reference` twin on `Device::flex()`.
//!
//! Where no adapter exists, [`kernel_test_device`] prints one loud line saying so and how to
//! install one, and returns `None` so the test can return early — unless
//! `MILES_REQUIRE_KERNEL_TESTS=1` is set (CI sets it), in which case it panics so the test
//! fails instead of silently passing.

/// Environment variable that turns a missing kernel adapter into a test failure.
pub const REQUIRE_KERNEL_TESTS_ENV: &str = "MILES_REQUIRE_KERNEL_TESTS";

/// How to get a software adapter, printed when none is found.
pub const INSTALL_HINT: &str = "add Debian bookworm-backports and `apt-get install -t bookworm-backports \
mesa-vulkan-drivers libvulkan1` (lavapipe >= 25), or run `.ci/install-vulkan.sh`";

/// True when `MILES_REQUIRE_KERNEL_TESTS` is set to `1` / `true` / `yes`.
pub fn kernel_tests_required() -> bool {
    std::env::var(REQUIRE_KERNEL_TESTS_ENV)
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
        .unwrap_or(false)
}

/// Initialises (once per process) the wgpu runtime on the CPU adapter and returns its device,
/// or the reason it is unavailable. (`cargo xtask test` points `XDG_RUNTIME_DIR` at a private
/// folder, which silences wgpu's warnings about it.)
#[cfg(feature = "wgpu")]
pub fn kernel_device() -> Result<burn::tensor::Device, String> {
    use std::sync::OnceLock;
    static DEVICE: OnceLock<Result<burn::tensor::Device, String>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            burn::tensor::Device::wgpu_options()
                .device_kind(burn::tensor::DeviceKind::Cpu)
                .init()
                .map_err(|e| e.to_string())
        })
        .clone()
}

/// The device for a kernel test, or `None` (after a loud line on stderr) when the machine has
/// no adapter. Panics instead when [`kernel_tests_required`].
#[cfg(feature = "wgpu")]
pub fn kernel_test_device(test: &str) -> Option<burn::tensor::Device> {
    match kernel_device() {
        Ok(device) => Some(device),
        Err(reason) => {
            let line = format!(
                "!!! KERNEL TEST {test} NOT RUN: no wgpu adapter ({reason}). To run it, {INSTALL_HINT}."
            );
            if kernel_tests_required() {
                panic!("{line} ({REQUIRE_KERNEL_TESTS_ENV}=1 makes this a failure)");
            }
            eprintln!("{line}");
            None
        }
    }
}

/// Without the `wgpu` feature there is no kernel device: `None` after a loud line on stderr
/// naming the feature, or a panic when [`kernel_tests_required`]. (Crates whose tests reach
/// miles-ops' wgpu runtime through a workspace feature, `--features miles-ops/wgpu`, call
/// this without a `cfg` of their own.)
#[cfg(not(feature = "wgpu"))]
pub fn kernel_test_device(test: &str) -> Option<burn::tensor::Device> {
    let line = format!(
        "!!! KERNEL TEST {test} NOT RUN: miles-ops was built without its `wgpu` feature \
         (`--features miles-ops/wgpu`)."
    );
    if kernel_tests_required() {
        panic!("{line} ({REQUIRE_KERNEL_TESTS_ENV}=1 makes this a failure)");
    }
    eprintln!("{line}");
    None
}
