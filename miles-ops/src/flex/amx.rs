//! `bf16` matrix products on Intel AMX (Advanced Matrix Extensions: Sapphire Rapids and later
//! Xeons), with `f32` accumulation.
//!
//! flex multiplies `bf16` tensors by converting both operands to `f32` and running an `f32`
//! `gemm`; AMX's `tdpbf16ps` instead multiplies `bf16` tiles directly (one instruction: a
//! `16×32` by `32×16` tile product accumulated into `16×16` `f32`), several times faster per
//! core. [`matmul_bf16`] is the safe entry: operands are strided views of `bf16` or `f32`
//! data ([`MatrixView`]; `f32` values are rounded to `bf16` as [`to_bf16_bits`] does, what
//! `half`'s `bf16::from_f32` does), the product is written as `f32` or rounded to `bf16`
//! ([`Output`]).
//!
//! Layout: the left operand is packed once per call into tiles of 16 rows by 32 `bf16` of
//! `k` (`[m-tile][k-tile][16][32]`, rows padded to an even number of tiles); the right one is
//! packed inside each rayon task, one panel of two 16-column tiles at a time, in AMX's pair
//! layout (`[k-tile][16 k-pairs][16 columns][2]`) that `tdpbf16ps` reads. Each task then runs
//! a `2×2`-tile micro-kernel (`tmm0`–`tmm3` accumulate, `tmm4`/`tmm5` hold the left tiles,
//! `tmm6`/`tmm7` the right ones) down every pair of left row tiles, and writes its 32 output
//! columns. Edges (any `m`, `n`, `k`) are zero padding in the packed tiles; only the valid
//! rows and columns are written.
//!
//! AMX treats `bf16` subnormal inputs as zero and flushes subnormal results (its `DAZ` /
//! `FTZ` behaviour), and sums pairs of products in its own order: results match an exact
//! product of the `bf16`-rounded operands to `f32` accumulation error, not bitwise.
//!
//! Whether AMX runs is decided once per process ([`available`]): the CPU's `amx-bf16` and
//! `amx-tile` bits (`cpuid` leaf 7), the Linux kernel's permission for the tile state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and `MILES_NO_AMX` unset (or not `1`). Without it
//! [`matmul_bf16`] runs the same product as one `f32` `gemm` over the `bf16`-rounded operands.

use std::sync::OnceLock;

use burn::tensor::bf16;
use rayon::prelude::*;

use crate::flex::gemm::matmul;

/// Environment variable that turns the AMX path off when set to `1`.
pub(crate) const NO_AMX_ENV: &str = "MILES_NO_AMX";

/// Rows of a tile (and `k` pairs of a right-hand tile).
const TILE_ROWS: usize = 16;
/// `bf16` values of `k` per tile row.
const TILE_K: usize = 32;
/// `bf16` values per packed tile (1 KiB).
const TILE_LEN: usize = TILE_ROWS * TILE_K;
/// Columns of a right-hand tile (and of an output tile).
const TILE_COLS: usize = 16;

/// The `bf16` bits of `x` rounded to nearest, ties to even; NaN stays NaN (quiet). Bit for
/// bit what `half`'s `bf16::from_f32` returns (and so flex's `f32` → `bf16` cast), written
/// branch-free so that conversion loops vectorise.
#[inline(always)]
pub(crate) fn to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = ((bits >> 16) | 0x0040) as u16;
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

/// The `f32` value of `bf16` bits.
#[inline(always)]
fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Whether [`matmul_bf16`] runs on AMX in this process (decided once; see the module docs).
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let off = std::env::var(NO_AMX_ENV).is_ok_and(|v| v.trim() == "1");
        !off && detect()
    })
}

/// The CPU's AMX bits and the kernel's permission for the tile state.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    let (amx_bf16, amx_tile) = ((edx >> 22) & 1 == 1, (edx >> 24) & 1 == 1);
    amx_bf16 && amx_tile && request_tile_permission()
}

/// Not x86-64 Linux: no AMX.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// Asks Linux for the AMX tile data state (process-wide, threads included): without it the
/// first tile instruction faults.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_permission() -> bool {
    /// `SYS_arch_prctl` on x86-64.
    const SYS_ARCH_PRCTL: i64 = 158;
    /// `ARCH_REQ_XCOMP_PERM`.
    const REQ_XCOMP_PERM: i64 = 0x1023;
    /// `XFEATURE_XTILEDATA`.
    const XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` only changes which CPU
    // state the kernel lets this process use; it reads and writes none of our memory. The
    // `syscall` instruction clobbers `rcx` and `r11`, declared; no stack is used.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") REQ_XCOMP_PERM,
            in("rsi") XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// The values a [`MatrixView`] reads.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Elements<'a> {
    /// `bf16` values, used as they are.
    Bf16(&'a [bf16]),
    /// `f32` values, rounded to `bf16` when packed.
    F32(&'a [f32]),
}

/// A logical matrix over `bf16` or `f32` data: element `(r, c)` is at `r·row_stride +
/// c·col_stride` (a transpose swaps the strides).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatrixView<'a> {
    /// The data.
    pub elements: Elements<'a>,
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

impl<'a> MatrixView<'a> {
    /// A view of `bf16` data with (row, column) strides.
    pub(crate) fn bf16(data: &'a [bf16], (row_stride, col_stride): (usize, usize)) -> Self {
        Self {
            elements: Elements::Bf16(data),
            row_stride,
            col_stride,
        }
    }

    /// A view of `f32` data with (row, column) strides.
    pub(crate) fn f32(data: &'a [f32], (row_stride, col_stride): (usize, usize)) -> Self {
        Self {
            elements: Elements::F32(data),
            row_stride,
            col_stride,
        }
    }

    /// The transposed view.
    pub(crate) fn t(self) -> Self {
        Self {
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    fn len(&self) -> usize {
        match self.elements {
            Elements::Bf16(d) => d.len(),
            Elements::F32(d) => d.len(),
        }
    }

    /// Whether a `rows × cols` matrix fits the data.
    fn covers(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        (rows - 1)
            .checked_mul(self.row_stride)
            .zip((cols - 1).checked_mul(self.col_stride))
            .and_then(|(a, b)| a.checked_add(b))
            .is_some_and(|last| last < self.len())
    }

    /// `out.len()` consecutive `bf16` values from `(row, col)`, along the row
    /// (`along_row`) or down the column. Contiguous runs are a vectorised copy / conversion.
    #[inline]
    fn read_run(&self, row: usize, col: usize, along_row: bool, out: &mut [u16]) {
        let start = row * self.row_stride + col * self.col_stride;
        let step = if along_row {
            self.col_stride
        } else {
            self.row_stride
        };
        let len = out.len();
        match self.elements {
            Elements::Bf16(d) if step == 1 => {
                for (o, x) in out.iter_mut().zip(&d[start..start + len]) {
                    *o = x.to_bits();
                }
            }
            Elements::F32(d) if step == 1 => {
                for (o, &x) in out.iter_mut().zip(&d[start..start + len]) {
                    *o = to_bf16_bits(x);
                }
            }
            Elements::Bf16(d) => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = d[start + j * step].to_bits();
                }
            }
            Elements::F32(d) => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = to_bf16_bits(d[start + j * step]);
                }
            }
        }
    }

    /// The `rows × cols` matrix as row-major `f32` values of its `bf16` rounding.
    fn to_rounded_f32(self, rows: usize, cols: usize) -> Vec<f32> {
        let mut bits = vec![0u16; cols];
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            self.read_run(r, 0, true, &mut bits);
            out.extend(bits.iter().map(|&b| bf16_bits_to_f32(b)));
        }
        out
    }
}

/// The element type [`matmul_bf16`] writes: `f32` as accumulated, or `bf16` rounded.
pub(crate) trait Output: Copy + Send + Sync {
    /// `x` as this type.
    fn from_f32(x: f32) -> Self;
}

impl Output for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Output for bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_bits(to_bf16_bits(x))
    }
}

/// `dst[m×n] = lhs[m×k] · rhs[k×n]` over the `bf16` values of both operands (`f32` ones
/// rounded), accumulated in `f32`; row `i` of `dst` starts at `i·dst_rs`. On AMX when
/// [`available`] (in parallel over the rayon pool), otherwise one `f32` `gemm`.
///
/// # Panics
///
/// When a view or `dst` is too short for its shape, or `dst_rs < n` (caller bugs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_bf16<T: Output>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    lhs: MatrixView<'_>,
    rhs: MatrixView<'_>,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst_rs >= n, "output row stride {dst_rs} below {n} columns");
    assert!(
        (m - 1)
            .checked_mul(dst_rs)
            .and_then(|x| x.checked_add(n))
            .is_some_and(|end| end <= dst.len()),
        "output too short"
    );
    assert!(lhs.covers(m, k), "left operand too short for {m}×{k}");
    assert!(rhs.covers(k, n), "right operand too short for {k}×{n}");
    if k == 0 {
        for row in 0..m {
            dst[row * dst_rs..row * dst_rs + n].fill(T::from_f32(0.0));
        }
        return;
    }
    if available() {
        amx_matmul(m, n, k, dst, dst_rs, lhs, rhs);
    } else {
        let (a, b) = (lhs.to_rounded_f32(m, k), rhs.to_rounded_f32(k, n));
        let mut c = vec![0.0f32; m * n];
        matmul(m, n, k, &mut c, n, false, &a, (k, 1), &b, (n, 1), 1.0);
        for row in 0..m {
            for (d, &x) in dst[row * dst_rs..row * dst_rs + n]
                .iter_mut()
                .zip(&c[row * n..(row + 1) * n])
            {
                *d = T::from_f32(x);
            }
        }
    }
}

/// The left operand in tiles: `[m-tile][k-tile][16 rows][32 k]`, `m_tiles` even, zero padded.
fn pack_lhs(lhs: MatrixView<'_>, m: usize, k: usize, m_tiles: usize, k_tiles: usize) -> Vec<u16> {
    let mut packed = vec![0u16; m_tiles * k_tiles * TILE_LEN];
    let columns_contiguous = lhs.row_stride == 1 && lhs.col_stride != 1;
    packed
        .par_chunks_mut(k_tiles * TILE_LEN)
        .enumerate()
        .for_each(|(tile, block)| {
            let row0 = tile * TILE_ROWS;
            let rows = m.saturating_sub(row0).min(TILE_ROWS);
            if rows == 0 {
                return;
            }
            if columns_contiguous {
                // Read down the columns (contiguous) 32 values of `k` at a time, then
                // transpose the 32×16 block into the tile's rows.
                let mut runs = [[0u16; TILE_ROWS]; TILE_K];
                for kt in 0..k_tiles {
                    let len = (k - kt * TILE_K).min(TILE_K);
                    for (j, run) in runs[..len].iter_mut().enumerate() {
                        lhs.read_run(row0, kt * TILE_K + j, false, &mut run[..rows]);
                    }
                    let tile = &mut block[kt * TILE_LEN..(kt + 1) * TILE_LEN];
                    for (r, tile_row) in tile.chunks_exact_mut(TILE_K).take(rows).enumerate() {
                        for (t, run) in tile_row[..len].iter_mut().zip(&runs[..len]) {
                            *t = run[r];
                        }
                    }
                }
            } else {
                for r in 0..rows {
                    for kt in 0..k_tiles {
                        let len = (k - kt * TILE_K).min(TILE_K);
                        let at = kt * TILE_LEN + r * TILE_K;
                        lhs.read_run(row0 + r, kt * TILE_K, true, &mut block[at..at + len]);
                    }
                }
            }
        });
    packed
}

/// Columns `col0..col0 + 32` of the right operand (zero beyond `n`) as two tiles in AMX's
/// pair layout, `[tile][k-tile][16 k-pairs][16 columns][2]`, into `panel`.
fn pack_rhs_panel(
    rhs: MatrixView<'_>,
    k: usize,
    n: usize,
    col0: usize,
    k_tiles: usize,
    panel: &mut [u16],
) {
    let cols = (n - col0).min(2 * TILE_COLS);
    if cols < 2 * TILE_COLS || !k.is_multiple_of(TILE_K) {
        panel.fill(0);
    }
    let at = |kk: usize, c: usize| {
        (c / TILE_COLS) * k_tiles * TILE_LEN
            + (kk / TILE_K) * TILE_LEN
            + ((kk % TILE_K) / 2) * (2 * TILE_COLS)
            + (c % TILE_COLS) * 2
            + kk % 2
    };
    if rhs.row_stride == 1 && rhs.col_stride != 1 {
        // `k` contiguous for each column (a transposed `[n, k]` weight): read 32 values of
        // `k` per column, then write each pair of them at its (k-pair, column) place.
        let mut runs = [[0u16; TILE_K]; 2 * TILE_COLS];
        for kt in 0..k_tiles {
            let len = (k - kt * TILE_K).min(TILE_K);
            for (c, run) in runs[..cols].iter_mut().enumerate() {
                rhs.read_run(kt * TILE_K, col0 + c, false, &mut run[..len]);
                run[len..].fill(0);
            }
            for (t, tile_runs) in runs.chunks_exact(TILE_COLS).enumerate() {
                let at = at(kt * TILE_K, t * TILE_COLS);
                let tile = &mut panel[at..at + TILE_LEN];
                for (kp, row) in tile.chunks_exact_mut(2 * TILE_COLS).enumerate() {
                    for (pair, run) in row.chunks_exact_mut(2).zip(tile_runs) {
                        pair[0] = run[2 * kp];
                        pair[1] = run[2 * kp + 1];
                    }
                }
            }
        }
    } else {
        // Two rows of `k` (a pair) at a time, interleaved column by column.
        let (mut even, mut odd) = ([0u16; 2 * TILE_COLS], [0u16; 2 * TILE_COLS]);
        for kk in (0..k).step_by(2) {
            rhs.read_run(kk, col0, true, &mut even[..cols]);
            if kk + 1 < k {
                rhs.read_run(kk + 1, col0, true, &mut odd[..cols]);
            } else {
                odd = [0; 2 * TILE_COLS];
            }
            for t in 0..2 {
                let at = at(kk, t * TILE_COLS);
                let pairs = &mut panel[at..at + 2 * TILE_COLS];
                let (e, o) = (
                    &even[t * TILE_COLS..(t + 1) * TILE_COLS],
                    &odd[t * TILE_COLS..(t + 1) * TILE_COLS],
                );
                for ((pair, &e), &o) in pairs.chunks_exact_mut(2).zip(e).zip(o) {
                    pair[0] = e;
                    pair[1] = o;
                }
            }
        }
    }
}

/// AMX's tile configuration (`ldtilecfg`'s 64-byte operand).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Palette 1, tiles 0–7 all 16 rows of 64 bytes.
    fn full() -> Self {
        let mut config = Self {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            config.bytes_per_row[t] = 64;
            config.rows[t] = TILE_ROWS as u8;
        }
        config
    }
}

/// The output pointer shared by the tasks; each writes its own columns.
struct OutputPtr<T>(*mut T);
// SAFETY: the tasks write disjoint elements (see `amx_matmul`), so sending and sharing the
// pointer between threads is sound for `T: Send`.
unsafe impl<T: Send> Send for OutputPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for OutputPtr<T> {}

/// The AMX path of [`matmul_bf16`], whose checks it relies on (shapes covered by the views,
/// `dst` long enough, `k ≥ 1`, [`available`]).
#[allow(clippy::too_many_arguments)]
fn amx_matmul<T: Output>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    lhs: MatrixView<'_>,
    rhs: MatrixView<'_>,
) {
    let m_tiles = m.div_ceil(2 * TILE_ROWS) * 2;
    let k_tiles = k.div_ceil(TILE_K);
    let panels = n.div_ceil(2 * TILE_COLS);
    let packed_lhs = pack_lhs(lhs, m, k, m_tiles, k_tiles);
    let out = OutputPtr(dst.as_mut_ptr());
    let out = &out;
    let tile_stride = k_tiles * TILE_LEN;
    (0..panels).into_par_iter().for_each(|p| {
        let col0 = p * 2 * TILE_COLS;
        let mut panel = vec![0u16; 2 * tile_stride];
        pack_rhs_panel(rhs, k, n, col0, k_tiles, &mut panel);
        let config = TileConfig::full();
        // SAFETY: `available()` holds (checked by `matmul_bf16`, the only caller), so the
        // CPU has AMX and the kernel allows its state; `ldtilecfg` reads the 64 bytes of
        // `config` (64-byte aligned) and writes no memory.
        unsafe {
            std::arch::asm!(
                "ldtilecfg [{}]",
                in(reg) &config as *const TileConfig,
                options(nostack, readonly),
            );
        }
        let mut acc = [0.0f32; 4 * TILE_ROWS * TILE_COLS];
        let (b0, b1) = panel.split_at(tile_stride);
        for mp in 0..m_tiles / 2 {
            let a0 = &packed_lhs[2 * mp * tile_stride..(2 * mp + 1) * tile_stride];
            let a1 = &packed_lhs[(2 * mp + 1) * tile_stride..(2 * mp + 2) * tile_stride];
            // SAFETY: tiles are configured as 16 rows of 64 bytes; each `tileloadd` reads 16
            // rows 64 bytes apart from `a0`/`a1`/`b0`/`b1` advanced by 1 KiB per k-tile, so
            // `k_tiles` (≥ 1) iterations read exactly the `k_tiles · 1 KiB` of each slice;
            // the four `tilestored` write 4 KiB, all of `acc`. Tile registers are declared
            // clobbered, general registers as outputs; no stack is used.
            unsafe {
                std::arch::asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    "2:",
                    "tileloadd tmm4, [{a0} + {s}*1]",
                    "tileloadd tmm5, [{a1} + {s}*1]",
                    "tileloadd tmm6, [{b0} + {s}*1]",
                    "tileloadd tmm7, [{b1} + {s}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "add {a0}, 1024",
                    "add {a1}, 1024",
                    "add {b0}, 1024",
                    "add {b1}, 1024",
                    "dec {n}",
                    "jnz 2b",
                    "tilestored [{c} + {s}*1], tmm0",
                    "add {c}, 1024",
                    "tilestored [{c} + {s}*1], tmm1",
                    "add {c}, 1024",
                    "tilestored [{c} + {s}*1], tmm2",
                    "add {c}, 1024",
                    "tilestored [{c} + {s}*1], tmm3",
                    a0 = inout(reg) a0.as_ptr() => _,
                    a1 = inout(reg) a1.as_ptr() => _,
                    b0 = inout(reg) b0.as_ptr() => _,
                    b1 = inout(reg) b1.as_ptr() => _,
                    n = inout(reg) k_tiles => _,
                    c = inout(reg) acc.as_mut_ptr() => _,
                    s = in(reg) 64usize,
                    out("tmm0") _,
                    out("tmm1") _,
                    out("tmm2") _,
                    out("tmm3") _,
                    out("tmm4") _,
                    out("tmm5") _,
                    out("tmm6") _,
                    out("tmm7") _,
                    options(nostack),
                );
            }
            // acc: tiles (row half, column half) = (0,0), (0,1), (1,0), (1,1).
            for (t, tile) in acc.chunks_exact(TILE_ROWS * TILE_COLS).enumerate() {
                let row0 = mp * 2 * TILE_ROWS + (t / 2) * TILE_ROWS;
                let c0 = col0 + (t % 2) * TILE_COLS;
                let rows = m.saturating_sub(row0).min(TILE_ROWS);
                let cols = n.saturating_sub(c0).min(TILE_COLS);
                for r in 0..rows {
                    let src = &tile[r * TILE_COLS..r * TILE_COLS + cols];
                    // SAFETY: row0 + r < m and c0 + cols ≤ n, so the run lies inside `dst`
                    // (checked by `matmul_bf16`: (m−1)·dst_rs + n ≤ len, dst_rs ≥ n). Tasks
                    // own disjoint column ranges `col0..col0 + 32`, so no two write the
                    // same element, and `dst` stays exclusively borrowed for the call.
                    let row = unsafe {
                        std::slice::from_raw_parts_mut(out.0.add((row0 + r) * dst_rs + c0), cols)
                    };
                    for (d, &x) in row.iter_mut().zip(src) {
                        *d = T::from_f32(x);
                    }
                }
            }
        }
        // SAFETY: AMX is available (as above); `tilerelease` resets the tile state.
        unsafe {
            std::arch::asm!(
                "tilerelease",
                out("tmm0") _,
                out("tmm1") _,
                out("tmm2") _,
                out("tmm3") _,
                out("tmm4") _,
                out("tmm5") _,
                out("tmm6") _,
                out("tmm7") _,
                options(nostack, nomem),
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in `[-1, 1)` with a spread of exponents.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                u * if i % 7 == 0 { 8.0 } else { 1.0 }
            })
            .collect()
    }

    /// `Σ_k lhs(i, k)·rhs(k, j)` in `f64` over the `bf16`-rounded operands.
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        lhs: MatrixView<'_>,
        rhs: MatrixView<'_>,
    ) -> Vec<f64> {
        let (a, b) = (lhs.to_rounded_f32(m, k), rhs.to_rounded_f32(k, n));
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|kk| f64::from(a[i * k + kk]) * f64::from(b[kk * n + j]))
                    .sum();
            }
        }
        c
    }

    fn check(m: usize, n: usize, k: usize, lhs: MatrixView<'_>, rhs: MatrixView<'_>) {
        let expected = reference(m, n, k, lhs, rhs);
        let scale: Vec<f64> = {
            let (a, b) = (lhs.to_rounded_f32(m, k), rhs.to_rounded_f32(k, n));
            (0..m * n)
                .map(|ij| {
                    let (i, j) = (ij / n, ij % n);
                    (0..k)
                        .map(|kk| f64::from((a[i * k + kk] * b[kk * n + j]).abs()))
                        .sum()
                })
                .collect()
        };
        // f32 output with a padded row stride: padding must stay untouched.
        let dst_rs = n + 3;
        let mut dst = vec![7.5f32; (m - 1) * dst_rs + n + 2];
        matmul_bf16(m, n, k, &mut dst, dst_rs, lhs, rhs);
        let mut rounded = vec![bf16::from_f32(0.0); m * n];
        matmul_bf16(m, n, k, &mut rounded, n, lhs, rhs);
        for i in 0..m {
            for j in 0..n {
                let (e, got) = (expected[i * n + j], dst[i * dst_rs + j]);
                // f32 accumulation: at most about k + 2 roundings of 2⁻²⁴ relative to Σ|a·b|.
                let tol = (k as f64 + 2.0) * 6e-8 * scale[i * n + j];
                assert!(
                    (f64::from(got) - e).abs() <= tol,
                    "{m}×{n}×{k} ({i}, {j}): {got} vs {e}"
                );
                assert_eq!(rounded[i * n + j], bf16::from_f32(got), "({i}, {j})");
            }
            assert!(dst[i * dst_rs + n..].iter().take(3).all(|&x| x == 7.5));
        }
        assert_eq!(dst[dst.len() - 2..], [7.5, 7.5]);
    }

    #[test]
    fn the_rounding_is_halfs_from_f32() {
        let mut edge = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN: made quiet
            f32::from_bits(0xffc1_2345),
            f32::from_bits(0x7f7f_8000), // tie at the top: rounds to infinity
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0x0000_0001), // subnormals
            f32::from_bits(0x0000_8000),
            f32::from_bits(0x0001_8000),
            f32::from_bits(0x807f_ffff),
        ];
        // Ties (even and odd low bit), just below / above a tie, around 1.
        for base in [0x3f80_0000u32, 0x3f81_0000, 0xbf80_0000, 0x4049_0000] {
            for low in [0x7fffu32, 0x8000, 0x8001, 0xffff, 0x0001] {
                edge.push(f32::from_bits(base | low));
            }
        }
        edge.extend(values(4096, 3));
        for x in edge {
            assert_eq!(
                to_bf16_bits(x),
                bf16::from_f32(x).to_bits(),
                "{x:e} ({:#010x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn products_match_an_f64_reference_across_tile_edges() {
        println!("AMX path: {}", available());
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 7, 3),
            (16, 16, 32),
            (17, 33, 31),
            (37, 45, 70),
            (33, 64, 97),
        ] {
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let a16: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
            // Row-major f32 `a`, row-major `b`.
            check(
                m,
                n,
                k,
                MatrixView::f32(&a, (k, 1)),
                MatrixView::f32(&b, (n, 1)),
            );
            // bf16 `a` stored transposed (`[k, m]`), `b` stored transposed (`[n, k]`).
            let at: Vec<bf16> = (0..k * m).map(|i| a16[(i % m) * k + i / m]).collect();
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            check(
                m,
                n,
                k,
                MatrixView::bf16(&at, (m, 1)).t(),
                MatrixView::f32(&bt, (k, 1)).t(),
            );
            // General strides (neither unit): every other element.
            let a2: Vec<f32> = a.iter().flat_map(|&x| [x, f32::NAN]).collect();
            let b2: Vec<bf16> = b
                .iter()
                .flat_map(|&x| [bf16::from_f32(x), bf16::NAN])
                .collect();
            check(
                m,
                n,
                k,
                MatrixView::f32(&a2, (2 * k, 2)),
                MatrixView::bf16(&b2, (2 * n, 2)),
            );
        }
    }

    #[test]
    fn empty_k_writes_zeros() {
        let mut dst = vec![1.0f32; 6];
        matmul_bf16(
            2,
            3,
            0,
            &mut dst,
            3,
            MatrixView::f32(&[], (0, 1)),
            MatrixView::f32(&[], (3, 1)),
        );
        assert_eq!(dst, [0.0; 6]);
    }
}
