//! The grouped expert matmul on flex against its tensor-op form (a slice of the rows and a
//! narrow of the stacked weight per group): output and both gradients, with empty groups,
//! fewer groups than experts, one row per group, and the shape errors.

use burn::tensor::{Device, Tensor};
use miles_ops::OpsError;
use miles_ops::{grouped_matmul, grouped_matmul_reference};

use crate::common::{assert_rel_close, lcg, to_vec};

fn run(fused: bool, sizes: &[usize], experts: usize, m: usize, k: usize) -> [Vec<f32>; 3] {
    let device = Device::flex().autodiff();
    let rows: usize = sizes.iter().sum();
    let x = Tensor::<1>::from_floats(lcg(rows * k, 1, 1.0).as_slice(), &device)
        .reshape([rows, k])
        .require_grad();
    let w = Tensor::<1>::from_floats(lcg(experts * m * k, 2, 0.5).as_slice(), &device)
        .reshape([experts, m, k])
        .require_grad();
    let y = if fused {
        grouped_matmul(x.clone(), w.clone(), sizes).unwrap()
    } else {
        grouped_matmul_reference(x.clone(), w.clone(), sizes)
    };
    let c = Tensor::<1>::from_floats(lcg(rows * m, 3, 1.0).as_slice(), &device).reshape([rows, m]);
    let grads = (y.clone() * c).sum().backward();
    [
        to_vec(y.detach()),
        to_vec(x.grad(&grads).unwrap()),
        to_vec(w.grad(&grads).unwrap()),
    ]
}

fn compare(sizes: &[usize], experts: usize, m: usize, k: usize) {
    let (f, r) = (
        run(true, sizes, experts, m, k),
        run(false, sizes, experts, m, k),
    );
    for (i, what) in ["y", "dx", "dw"].iter().enumerate() {
        assert_rel_close(what, &f[i], &r[i], 1e-5);
    }
}

#[test]
fn grouped_matmul_matches_slices_and_narrows() {
    compare(&[5, 0, 17, 3, 0, 40], 6, 24, 32);
    compare(&[1, 1, 1], 3, 8, 5);
    // Fewer groups listed than experts: the rest have no rows (and zero gradients).
    compare(&[9, 4], 5, 12, 16);
}

#[test]
fn bad_sizes_are_typed_errors() {
    let device = Device::flex();
    let x = Tensor::<2>::zeros([6, 4], &device);
    let w = Tensor::<3>::zeros([2, 3, 4], &device);
    let err = grouped_matmul(x.clone(), w.clone(), &[2, 3]).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "grouped_matmul group sizes (sum)",
            ..
        }
    ));
    let err = grouped_matmul(x.clone(), w.clone(), &[2, 2, 2]).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "grouped_matmul weights",
            ..
        }
    ));
    let err = grouped_matmul(x, Tensor::<3>::zeros([2, 3, 5], &device), &[3, 3]).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "grouped_matmul weights",
            ..
        }
    ));
}

/// The inference path over weights packed once ([`miles_ops::PackedExperts`],
/// `[experts, in, out + pad]`) on plain flex against the tensor-op form on the HF-layout
/// stack: empty groups, fewer groups than experts, one row per group, decode-sized groups;
/// and the shape errors.
#[test]
fn packed_experts_forward_equals_the_reference() {
    use miles_ops::{PackedExperts, grouped_matmul_packed};
    let device = Device::flex();
    for (sizes, experts, m, k) in [
        (vec![3usize, 0, 5, 1], 4usize, 24usize, 16usize),
        (vec![2, 2], 5, 256, 64),
        (vec![1, 1, 1], 3, 7, 9),
        (vec![8, 9, 7, 8, 0, 0, 6, 10], 8, 512, 96),
    ] {
        let rows: usize = sizes.iter().sum();
        let x =
            Tensor::<1>::from_floats(lcg(rows * k, 1, 1.0).as_slice(), &device).reshape([rows, k]);
        let w = Tensor::<1>::from_floats(lcg(experts * m * k, 2, 0.5).as_slice(), &device)
            .reshape([experts, m, k]);
        let packed = PackedExperts::new(w.clone());
        let ours = grouped_matmul_packed(x.clone(), &packed, &sizes).unwrap();
        let reference = grouped_matmul_reference(x, w, &sizes);
        assert_rel_close(
            &format!("{sizes:?} x {m}x{k}"),
            &to_vec(ours),
            &to_vec(reference),
            1e-5,
        );
    }
    let x = Tensor::<2>::zeros([4, 8], &device);
    let packed = PackedExperts::new(Tensor::<3>::zeros([2, 5, 7], &device));
    assert!(matches!(
        grouped_matmul_packed(x.clone(), &packed, &[2, 2]),
        Err(OpsError::ShapeMismatch { .. })
    ));
    let packed = PackedExperts::new(Tensor::<3>::zeros([2, 5, 8], &device));
    assert!(matches!(
        grouped_matmul_packed(x, &packed, &[2, 1]),
        Err(OpsError::ShapeMismatch { .. })
    ));
}

/// The host counting sort of the expert bucketing on a hand-checked table: stable order,
/// empty experts, invalid ids after the last group.
#[test]
fn host_buckets_are_a_stable_counting_sort() {
    use miles_ops::HostBuckets;
    // 3 tokens × top_k 2 over 4 experts: pairs 0..6 choose [2, 0, 2, 1, 0, 2].
    let b = HostBuckets::new(&[2, 0, 2, 1, 0, 2], 2, 4);
    assert_eq!(b.offsets, vec![0, 2, 3, 6, 6]);
    assert_eq!(b.pair_of_slot, vec![1, 4, 3, 0, 2, 5]);
    assert_eq!(b.token_of_slot, vec![0, 2, 1, 0, 1, 2]);
    assert_eq!(b.slot_of_pair, vec![3, 0, 4, 2, 1, 5]);
    assert_eq!(b.invalid, 0);
    // Invalid ids (-1, 4) go after the valid pairs in pair order.
    let b = HostBuckets::new(&[-1, 1, 4, 1], 1, 4);
    assert_eq!(b.offsets, vec![0, 0, 2, 2, 2]);
    assert_eq!(b.pair_of_slot, vec![1, 3, 0, 2]);
    assert_eq!(b.invalid, 2);
}

/// On flex, the bucketing op and the device-offset grouped matmul agree with the host twin
/// and the host-size op (values and gradients).
#[test]
fn flex_bucketing_and_offset_matmul_match_host_versions() {
    use burn::tensor::{Int, TensorData};
    use miles_ops::grouped_matmul_offsets;
    use miles_ops::{HostBuckets, bucket_by_expert};
    let device = Device::flex().autodiff();
    let ids: Vec<i64> = vec![3, 0, 3, 1, 1, 0, 3, 3, 2, 0];
    let host = HostBuckets::new(&ids, 2, 5);
    let t = Tensor::<1, Int>::from_data(TensorData::new(ids, [10]), &device).reshape([5, 2]);
    let b = bucket_by_expert(t, 5).unwrap();
    let read = |t: Tensor<1, Int>| -> Vec<usize> {
        t.into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as usize)
            .collect()
    };
    assert_eq!(read(b.offsets.clone()), host.offsets);
    assert_eq!(read(b.pair_of_slot), host.pair_of_slot);
    assert_eq!(read(b.slot_of_pair), host.slot_of_pair);
    let sizes: Vec<usize> = host.offsets.windows(2).map(|w| w[1] - w[0]).collect();
    let (rows, m, k) = (10, 6, 4);
    let x = Tensor::<1>::from_floats(lcg(rows * k, 1, 1.0).as_slice(), &device)
        .reshape([rows, k])
        .require_grad();
    let w = Tensor::<1>::from_floats(lcg(5 * m * k, 2, 1.0).as_slice(), &device)
        .reshape([5, m, k])
        .require_grad();
    let c = Tensor::<1>::from_floats(lcg(rows * m, 3, 1.0).as_slice(), &device).reshape([rows, m]);
    let y = grouped_matmul_offsets(x.clone(), w.clone(), b.offsets).unwrap();
    let g = (y.clone() * c.clone()).sum().backward();
    let yr = grouped_matmul(x.clone(), w.clone(), &sizes).unwrap();
    let gr = (yr.clone() * c).sum().backward();
    let v = |t: Tensor<2>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    assert_eq!(v(y.detach()), v(yr.detach()));
    assert_eq!(v(x.grad(&g).unwrap()), v(x.grad(&gr).unwrap()));
    let v3 = |t: Tensor<3>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    assert_eq!(v3(w.grad(&g).unwrap()), v3(w.grad(&gr).unwrap()));
}
