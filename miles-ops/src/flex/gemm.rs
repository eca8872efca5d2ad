//! One strided `gemm` call on the calling thread, bounds-checked: the building block of the
//! flex attention, grouped-matmul and linear loops (each runs it inside its own rayon task).

/// `dst[m×n] = beta·lhs[m×k]·rhs[k×n] (+ dst when `accumulate`)`, with explicit
/// (row, column) strides, on the calling thread.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[f32],
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: &[f32],
    (rhs_rs, rhs_cs): (usize, usize),
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Bounds of every element gemm touches, checked here so the raw pointers stay inside.
    assert!(dst.len() >= (m - 1) * dst_rs + n);
    if k > 0 {
        assert!(lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs);
        assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs);
    }
    // SAFETY: the asserts above keep every (row, column) gemm reads or writes inside the
    // slices; `dst` is exclusively borrowed and does not alias `lhs` / `rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
