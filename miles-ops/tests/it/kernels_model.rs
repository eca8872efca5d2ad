//! CubeCL kernels of the fused model ops (RMSNorm, RoPE, SwiGLU, grouped expert matmul) on the
//! kernel test device against the same ops on flex (their native implementations, which
//! `norm.rs`, `swiglu.rs` and `grouped.rs` check against tensor-op definitions): values and
//! gradients through autodiff.
//!
//! Shapes hit the edges: rows not a multiple of the reduction block, a row count past one
//! weight-gradient chunk (256 rows), head dims 64 and 128, a strided (head-swapped) input,
//! partial rotary dims, empty expert groups and fewer groups than experts. Tolerances: the
//! element-wise ops (RoPE, SwiGLU) agree to a few ulp (1e-6 of the largest magnitude; the
//! device's `exp` may differ by an ulp); reductions in another order (tree vs sequential) to
//! 1e-5 for values and 2e-5 for summed gradients.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use burn::tensor::{Device, Int, Tensor};
use miles_ops::grouped_matmul;
use miles_ops::kernels::kernel_test_device;
use miles_ops::swiglu;
use miles_ops::{rms_norm, rope};

use crate::common::{assert_rel_close, lcg, to_vec};

/// `[b, h, s, d]` from `lcg` data, built as `[b, s, h, d]` and swapped when `strided`.
fn input4(shape: [usize; 4], seed: u64, strided: bool, device: &Device) -> (Tensor<4>, Tensor<4>) {
    let [b, h, s, d] = shape;
    let data = Tensor::<1>::from_floats(lcg(b * h * s * d, seed, 2.0).as_slice(), device);
    if strided {
        let leaf = data.reshape([b, s, h, d]).require_grad();
        (leaf.clone(), leaf.swap_dims(1, 2))
    } else {
        let leaf = data.reshape([b, h, s, d]).require_grad();
        (leaf.clone(), leaf)
    }
}

fn weights4(shape: [usize; 4], seed: u64, device: &Device) -> Tensor<4> {
    let n = shape.iter().product();
    Tensor::<1>::from_floats(lcg(n, seed, 1.0).as_slice(), device).reshape(shape)
}

fn norm_run(device: &Device, shape: [usize; 4], strided: bool) -> [Vec<f32>; 3] {
    let device = device.clone().autodiff();
    let (leaf, x) = input4(shape, 1, strided, &device);
    let d = shape[3];
    let w = Tensor::<1>::from_floats(lcg(d, 2, 1.0).as_slice(), &device).require_grad();
    let y = rms_norm(x, w.clone(), 1e-6).unwrap();
    let grads = (y.clone() * weights4(shape, 3, &device)).sum().backward();
    [
        to_vec(y.detach()),
        to_vec(leaf.grad(&grads).unwrap()),
        to_vec(w.grad(&grads).unwrap()),
    ]
}

#[test]
fn rms_norm_kernel_matches_flex() {
    let Some(dev) = kernel_test_device("rms_norm_kernel_matches_flex") else {
        return;
    };
    // Hidden-size rows (d = 40, not a power of two), q/k-norm rows over head dims 64 and 128
    // with 2·4·41 = 328 rows (two weight-gradient chunks), strided as attention heads are.
    for (shape, strided) in [
        ([2, 1, 17, 40], false),
        ([2, 4, 41, 64], true),
        ([1, 3, 5, 128], false),
    ] {
        let (c, f) = (
            norm_run(&dev, shape, strided),
            norm_run(&Device::flex(), shape, strided),
        );
        assert_rel_close("rms_norm y", &c[0], &f[0], 1e-5);
        assert_rel_close("rms_norm dx", &c[1], &f[1], 2e-5);
        assert_rel_close("rms_norm dw", &c[2], &f[2], 2e-5);
    }
}

fn rope_run(device: &Device, shape: [usize; 4], rot: usize, strided: bool) -> [Vec<f32>; 2] {
    let device = device.clone().autodiff();
    let [b, _, s, _] = shape;
    let (leaf, x) = input4(shape, 4, strided, &device);
    // Tables as a model builds them, positions restarting (packed sequences).
    let flex = Device::flex();
    let positions: Vec<i64> = (0..b * s).map(|i| ((i % s) % 7) as i64).collect();
    let pos = Tensor::<1, Int>::from_ints(positions.as_slice(), &flex)
        .float()
        .reshape([b, s, 1]);
    let inv: Vec<f32> = (0..rot / 2)
        .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rot as f32))
        .collect();
    let inv = Tensor::<1>::from_floats(inv.as_slice(), &flex).reshape([1, 1, rot / 2]);
    let freqs = pos * inv;
    let emb = Tensor::cat(vec![freqs.clone(), freqs], 2);
    // The same tables on both devices: computed on flex, copied.
    let cos = Tensor::<3>::from_data(emb.clone().cos().into_data(), &device);
    let sin = Tensor::<3>::from_data(emb.sin().into_data(), &device);
    let y = rope(x, cos, sin).unwrap();
    let grads = (y.clone() * weights4(shape, 5, &device)).sum().backward();
    [to_vec(y.detach()), to_vec(leaf.grad(&grads).unwrap())]
}

#[test]
fn rope_kernel_matches_flex() {
    let Some(dev) = kernel_test_device("rope_kernel_matches_flex") else {
        return;
    };
    for (shape, rot, strided) in [
        ([2, 3, 11, 64], 64, true),
        ([1, 2, 9, 128], 64, false),
        ([2, 1, 5, 40], 24, false),
    ] {
        let (c, f) = (
            rope_run(&dev, shape, rot, strided),
            rope_run(&Device::flex(), shape, rot, strided),
        );
        assert_rel_close("rope y", &c[0], &f[0], 1e-6);
        assert_rel_close("rope dx", &c[1], &f[1], 1e-6);
    }
}

fn swiglu_run(device: &Device, shape: [usize; 2]) -> [Vec<f32>; 3] {
    let device = device.clone().autodiff();
    let n = shape[0] * shape[1];
    // Gates up to ±12: both tails of the sigmoid.
    let gate = Tensor::<1>::from_floats(lcg(n, 6, 12.0).as_slice(), &device)
        .reshape(shape)
        .require_grad();
    let up = Tensor::<1>::from_floats(lcg(n, 7, 2.0).as_slice(), &device)
        .reshape(shape)
        .require_grad();
    let y = swiglu(gate.clone(), up.clone()).unwrap();
    let w = Tensor::<1>::from_floats(lcg(n, 8, 1.0).as_slice(), &device).reshape(shape);
    let grads = (y.clone() * w).sum().backward();
    [
        to_vec(y.detach()),
        to_vec(gate.grad(&grads).unwrap()),
        to_vec(up.grad(&grads).unwrap()),
    ]
}

#[test]
fn swiglu_kernel_matches_flex() {
    let Some(dev) = kernel_test_device("swiglu_kernel_matches_flex") else {
        return;
    };
    for shape in [[37, 96], [1, 5]] {
        let (c, f) = (swiglu_run(&dev, shape), swiglu_run(&Device::flex(), shape));
        assert_rel_close("swiglu y", &c[0], &f[0], 1e-6);
        assert_rel_close("swiglu d_gate", &c[1], &f[1], 1e-6);
        assert_rel_close("swiglu d_up", &c[2], &f[2], 1e-6);
    }
}

fn grouped_run(
    device: &Device,
    sizes: &[usize],
    experts: usize,
    m: usize,
    k: usize,
) -> [Vec<f32>; 3] {
    let device = device.clone().autodiff();
    let rows: usize = sizes.iter().sum();
    let x = Tensor::<1>::from_floats(lcg(rows * k, 1, 1.0).as_slice(), &device)
        .reshape([rows, k])
        .require_grad();
    let w = Tensor::<1>::from_floats(lcg(experts * m * k, 2, 0.5).as_slice(), &device)
        .reshape([experts, m, k])
        .require_grad();
    let y = grouped_matmul(x.clone(), w.clone(), sizes).unwrap();
    let c = Tensor::<1>::from_floats(lcg(rows * m, 3, 1.0).as_slice(), &device).reshape([rows, m]);
    let grads = (y.clone() * c).sum().backward();
    [
        to_vec(y.detach()),
        to_vec(x.grad(&grads).unwrap()),
        to_vec(w.grad(&grads).unwrap()),
    ]
}

#[test]
fn grouped_matmul_kernel_matches_flex() {
    let Some(dev) = kernel_test_device("grouped_matmul_kernel_matches_flex") else {
        return;
    };
    // Empty groups (first, middle, trailing), one-row groups, fewer groups than experts.
    for (sizes, experts, m, k) in [
        (&[0usize, 5, 0, 17, 3, 40][..], 6, 24, 32),
        (&[1, 1, 1][..], 3, 8, 5),
        (&[9, 4][..], 5, 12, 16),
    ] {
        let (c, f) = (
            grouped_run(&dev, sizes, experts, m, k),
            grouped_run(&Device::flex(), sizes, experts, m, k),
        );
        assert_rel_close("grouped y", &c[0], &f[0], 1e-5);
        assert_rel_close("grouped dx", &c[1], &f[1], 1e-5);
        assert_rel_close("grouped dw", &c[2], &f[2], 1e-5);
    }
}

/// `tokens × top_k` pseudo-random expert ids in `0..experts` (plus `extra` fixed ids, e.g.
/// invalid ones, written over the first pairs).
fn random_ids(tokens: usize, top_k: usize, experts: usize, seed: u64, extra: &[i64]) -> Vec<i64> {
    let mut ids: Vec<i64> = lcg(tokens * top_k, seed, 1.0)
        .iter()
        .map(|v| (((v + 1.0) * 0.5 * experts as f32) as i64).min(experts as i64 - 1))
        .collect();
    for (slot, &id) in ids.iter_mut().zip(extra) {
        *slot = id;
    }
    ids
}

fn ints(t: Tensor<1, Int>) -> Vec<usize> {
    t.into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .unwrap()
        .into_iter()
        .map(|v| v as usize)
        .collect()
}

/// The device bucketing equals the host counting sort exactly (stable order included).
#[test]
fn expert_bucketing_kernel_matches_host_twin() {
    let Some(dev) = kernel_test_device("expert_bucketing_kernel_matches_host_twin") else {
        return;
    };
    use miles_ops::{HostBuckets, bucket_by_expert};
    // (tokens, top_k, experts, ids): random with empty experts (more experts than pairs),
    // every pair on one expert, one token, top_k 1, non-multiple sizes, invalid ids.
    let all_one: Vec<i64> = vec![3; 13 * 2];
    let cases: Vec<(usize, usize, usize, Vec<i64>)> = vec![
        (37, 8, 64, random_ids(37, 8, 64, 1, &[])),
        (5, 2, 40, random_ids(5, 2, 40, 2, &[])),
        (13, 2, 7, all_one),
        (1, 4, 16, random_ids(1, 4, 16, 3, &[])),
        (1, 1, 3, vec![2]),
        (301, 1, 5, random_ids(301, 1, 5, 4, &[])),
        (9, 3, 6, random_ids(9, 3, 6, 5, &[-1, 6, 1000, 2])),
    ];
    for (tokens, top_k, experts, ids) in cases {
        let host = HostBuckets::new(&ids, top_k, experts);
        let t = Tensor::<1, Int>::from_data(
            burn::tensor::TensorData::new(ids.clone(), [tokens * top_k]),
            &dev,
        )
        .reshape([tokens, top_k]);
        let b = bucket_by_expert(t, experts).unwrap();
        let what = format!("tokens {tokens} top_k {top_k} experts {experts}");
        assert_eq!(ints(b.offsets), host.offsets, "offsets, {what}");
        assert_eq!(
            ints(b.pair_of_slot),
            host.pair_of_slot,
            "pair_of_slot, {what}"
        );
        assert_eq!(
            ints(b.token_of_slot),
            host.token_of_slot,
            "token_of_slot, {what}"
        );
        assert_eq!(
            ints(b.slot_of_pair),
            host.slot_of_pair,
            "slot_of_pair, {what}"
        );
        assert_eq!(ints(b.invalid), vec![host.invalid], "invalid, {what}");
    }
}

/// [`grouped_matmul_offsets`] (device offsets) against [`grouped_matmul`] (host sizes) on
/// the kernel device, values and gradients, and rows past the last group zero.
#[test]
fn grouped_matmul_offsets_kernel_matches_host_sizes() {
    let Some(dev) = kernel_test_device("grouped_matmul_offsets_kernel_matches_host_sizes") else {
        return;
    };
    use miles_ops::{PackedExperts, grouped_matmul_offsets, grouped_matmul_offsets_packed};
    let (m, k) = (24, 32);
    for (sizes, experts, tail) in [
        (&[0usize, 5, 0, 17, 3, 40][..], 6, 0),
        (&[1, 1, 1][..], 3, 0),
        (&[9, 0, 4, 0, 0][..], 5, 3),
    ] {
        let rows: usize = sizes.iter().sum::<usize>() + tail;
        let device = dev.clone().autodiff();
        let x = Tensor::<1>::from_floats(lcg(rows * k, 1, 1.0).as_slice(), &device)
            .reshape([rows, k])
            .require_grad();
        let w = Tensor::<1>::from_floats(lcg(experts * m * k, 2, 0.5).as_slice(), &device)
            .reshape([experts, m, k])
            .require_grad();
        let mut offsets = vec![0i64];
        for &n in sizes {
            offsets.push(offsets.last().unwrap() + n as i64);
        }
        let off = Tensor::<1, Int>::from_data(
            burn::tensor::TensorData::new(offsets, [experts + 1]),
            &device,
        );
        let c =
            Tensor::<1>::from_floats(lcg(rows * m, 3, 1.0).as_slice(), &device).reshape([rows, m]);
        let y = grouped_matmul_offsets(x.clone(), w.clone(), off.clone()).unwrap();
        let grads = (y.clone() * c.clone()).sum().backward();
        let got = [
            to_vec(y.clone().detach()),
            to_vec(x.grad(&grads).unwrap()),
            to_vec(w.grad(&grads).unwrap()),
        ];
        // Reference: host sizes over the grouped rows; the tail rows are zero.
        let head = rows - tail;
        let xr = Tensor::<1>::from_floats(&lcg(rows * k, 1, 1.0)[..head * k], &device)
            .reshape([head, k])
            .require_grad();
        let wr = Tensor::<1>::from_floats(lcg(experts * m * k, 2, 0.5).as_slice(), &device)
            .reshape([experts, m, k])
            .require_grad();
        let yr = grouped_matmul(xr.clone(), wr.clone(), sizes).unwrap();
        let gr = (yr.clone() * c.clone().slice([0..head, 0..m]))
            .sum()
            .backward();
        let mut want_y = to_vec(yr.detach());
        want_y.extend(std::iter::repeat_n(0.0, tail * m));
        let mut want_dx = to_vec(xr.grad(&gr).unwrap());
        want_dx.extend(std::iter::repeat_n(0.0, tail * k));
        let want_dw = to_vec(wr.grad(&gr).unwrap());
        assert_rel_close("offsets y", &got[0], &want_y, 1e-6);
        assert_rel_close("offsets dx", &got[1], &want_dx, 1e-6);
        assert_rel_close("offsets dw", &got[2], &want_dw, 1e-6);
        // The packed inference layout gives the same forward.
        let packed = PackedExperts::new(w.clone().detach());
        let yp = grouped_matmul_offsets_packed(x.clone().detach(), &packed, off).unwrap();
        assert_rel_close("offsets packed y", &to_vec(yp), &want_y, 1e-6);
    }
}
