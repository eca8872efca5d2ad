//! Helpers shared by miles-ops' integration tests (each test file uses a subset).
#![allow(dead_code)]

use burn::tensor::Tensor;

/// Deterministic pseudo-random numbers in [-scale, scale).
pub fn lcg(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A tensor's values as `f32`.
pub fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// max |a − b| ≤ tol · max |b| (relative to the reference's scale).
pub fn assert_rel_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err <= tol * scale,
        "{what}: max abs err {err} > {tol} × scale {scale}"
    );
}
