//! Launch geometry the CubeCL kernels share.

use cubecl::prelude::{CubeCount, CubeDim};

/// Most cubes launched along x (the WebGPU limit per dimension); kernels launched with fewer
/// cubes than work items walk the rest grid-stride.
pub(crate) const MAX_CUBES_X: usize = 65_535;

/// Units per cube of the delta-rule kernels: one per value column of the state.
pub(crate) const COLUMNS: usize = 64;

/// `n` cubes along x, at least one and at most [`MAX_CUBES_X`].
pub(crate) fn cubes_x(n: usize) -> CubeCount {
    CubeCount::Static(n.clamp(1, MAX_CUBES_X) as u32, 1, 1)
}

/// The launch geometry of the delta-rule kernels over `rows` (batch · heads) state rows of
/// `dv` columns, one unit per column: (cube count, units per cube, column blocks per row).
pub(crate) fn column_geometry(rows: usize, dv: usize) -> (CubeCount, CubeDim, usize) {
    let width = COLUMNS.min(dv).max(1);
    let blocks = dv.div_ceil(width);
    (
        cubes_x(rows * blocks),
        CubeDim::new_1d(width as u32),
        blocks,
    )
}
