//! HF-layout linear layers: [`Linear`] (`y = x Wᵀ + b`, `W: [out, in]`, optionally with a LoRA
//! adapter) and [`FusedLinear`], several of them read as one for inference.

use burn::module::{Module, Param};
use burn::tensor::Tensor;

use crate::error::BridgeError;
use crate::lora::{LoraAdapter, LoraForward};
use crate::nn::param::{Builder, Init, ParamRef, ParamVisitor};

/// `y = x W^T + b` with `W` in HF layout `[out, in]`, optionally with a LoRA adapter
/// (see [`crate::lora`]).
#[derive(Module, Debug)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: Param<Tensor<2>>,
    /// `[out]`, if the layer has a bias.
    pub bias: Option<Param<Tensor<1>>>,
    /// LoRA adapter, if attached (`CausalLm::with_lora`).
    pub lora: Option<LoraAdapter>,
}

impl Linear {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<Self, BridgeError> {
        let weight = b.param(&format!("{name}.weight"), [d_out, d_in], Init::Normal)?;
        let bias = if bias {
            Some(b.param(&format!("{name}.bias"), [d_out], Init::Zeros)?)
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            lora: None,
        })
    }

    /// The weight the layer multiplies by: `W`, or `W + scaling·B·A` with an adapter (the
    /// tensor `CausalLm::to_hf_tensors_merged` exports).
    pub fn effective_weight(&self) -> Tensor<2> {
        match &self.lora {
            Some(lora) => self.weight.val() + lora.delta(),
            None => self.weight.val(),
        }
    }

    /// Applies the layer to `[tokens, in]` rows. `x · Wᵀ` is [`miles_ops::linear_bf16`]: on
    /// Intel AMX for `bf16` tensors on flex; for `f32` training on flex
    /// [`miles_ops::linear_train`] (the same forward, `∂W` written once in `W`'s layout);
    /// `x.matmul(W.transpose())` otherwise.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let y = match &self.lora {
            Some(lora) if lora.mode == LoraForward::Factored => {
                let low = x.clone().matmul(lora.lora_a.val().transpose());
                miles_ops::linear_bf16(x, self.weight.val())
                    + low.matmul(lora.lora_b.val().transpose()) * lora.scaling
            }
            _ => miles_ops::linear_bf16(x, self.effective_weight()),
        };
        match &self.bias {
            Some(bias) => y + bias.val().unsqueeze_dim(0),
            None => y,
        }
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        f(&format!("{name}.weight"), ParamRef::R2(&self.weight));
        if let Some(bias) = &self.bias {
            f(&format!("{name}.bias"), ParamRef::R1(bias));
        }
    }
}

/// Several linear layers reading the same input as one: their weights (adapters merged)
/// stacked on the output axis, `[Σ out, in]`, and their biases (zeros for a layer without
/// one). Built once per weight version for inference (`CausalLm::fuse_projections`);
/// one matmul then replaces one per layer, and no training code ever sees it. On flex in
/// `f32` with AVX-512F the weights are packed into [`miles_ops::packed`]'s panels straight
/// from the layers' buffers (one pass over the weights, in parallel); with AVX2 and FMA only,
/// the layers' own buffers are multiplied in place by [`miles_ops::rows`]' kernels (no copy:
/// the stacked matrix is their rows read in turn); elsewhere on flex the weights are stacked
/// and stored transposed, `[in, Σ out]` row-major, the layout `gemm` reads fastest at decode
/// row counts ([`miles_ops::linear_t`]).
#[derive(Debug, Clone)]
pub struct FusedLinear {
    /// The stacked weight.
    pub weight: FusedWeight,
    /// `[Σ out]`, when any of the layers has a bias.
    pub bias: Option<Tensor<1>>,
    /// Output width of each fused layer, in order.
    pub widths: Vec<usize>,
}

/// Where the engine's decode matmuls read dense weights from, on flex in `f32` (what
/// [`crate::CausalLm::fuse_projections_with`] asks of every [`FusedLinear`]).
///
/// On a CPU with AVX-512F both kernels run: the packed panels are the faster decode at batch
/// rows above a few (at Qwen3-0.6B's shapes on an Intel Xeon, 32 rows: the in-place kernels
/// take 1.3–1.5x the panels' time, 8 rows 1.05–1.2x, one row the same: both are bound by
/// reading the weights there) but are
/// one more copy of every dense weight, built at every weight update; the in-place kernels
/// copy nothing. With AVX2 only the in-place kernels are the only ones, whatever is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeWeights {
    /// Packed panels where they apply (AVX-512F), else in place (AVX2): the fastest decode,
    /// for an engine that holds its weights alone (`miles serve`).
    #[default]
    Packed,
    /// Read in place wherever the in-place kernels apply (AVX-512F or AVX2): no copy of a
    /// dense weight and nothing rebuilt at a weight update, for an engine that serves the
    /// trainer's own buffers (`miles train`, `miles train-async`).
    InPlace,
}

/// How a [`FusedLinear`] stores its stacked weight.
#[derive(Debug, Clone)]
pub enum FusedWeight {
    /// `[Σ out, in]` (devices other than flex; stacked `bf16` projections on flex with AMX,
    /// multiplied by [`miles_ops::linear_bf16`] as [`Linear::forward`] does).
    Hf(Tensor<2>),
    /// `[in, Σ out]` contiguous (flex without the AVX-512F or AVX2 kernels).
    Transposed(Tensor<2>),
    /// Panels for the packed decode kernel (flex, `f32`, AVX-512F, [`DecodeWeights::Packed`]).
    Packed(miles_ops::packed::PackedMatrix),
    /// The layers' weights as they are, multiplied in place (flex, `f32`, AVX2 and FMA
    /// without AVX-512F, or AVX-512F with [`DecodeWeights::InPlace`]).
    Rows(miles_ops::rows::RowsMatrix),
}

impl FusedLinear {
    /// Stacks `layers` (all with the same input width), the decode weights as `decode` says.
    pub fn new(layers: &[&Linear], decode: DecodeWeights) -> Self {
        let weights: Vec<Tensor<2>> = layers.iter().map(|l| l.effective_weight()).collect();
        let widths: Vec<usize> = weights.iter().map(|w| w.dims()[0]).collect();
        let bias = layers.iter().any(|l| l.bias.is_some()).then(|| {
            let parts = layers
                .iter()
                .zip(&widths)
                .map(|(l, &n)| match &l.bias {
                    Some(b) => b.val(),
                    None => {
                        let w = l.weight.val();
                        Tensor::<1>::zeros([n], (&w.device(), w.dtype()))
                    }
                })
                .collect();
            Tensor::cat(parts, 0)
        });
        // Packed straight from the layers' weights where the panels apply, else the weights
        // read in place where the in-place kernels do (no stacked intermediate either way);
        // else stacked once and stored as `from_weight` does.
        let fused = packs(decode)
            .then(|| miles_ops::packed::PackedMatrix::stacked(weights.clone()))
            .flatten()
            .map(FusedWeight::Packed)
            .or_else(|| {
                miles_ops::rows::RowsMatrix::stacked(weights.clone()).map(FusedWeight::Rows)
            });
        let weight = match fused {
            Some(fused) => fused,
            None => {
                let stacked = match <[Tensor<2>; 1]>::try_from(weights) {
                    Ok([weight]) => weight,
                    Err(weights) => Tensor::cat(weights, 0),
                };
                // bf16 on flex with AMX: the HF layout through `linear_bf16`, the kernel the
                // trainer's `Linear::forward` runs (same bits per output column).
                if miles_ops::runs_amx(&stacked) {
                    FusedWeight::Hf(stacked)
                } else {
                    Self::from_weight(stacked, decode).weight
                }
            }
        };
        Self {
            weight,
            bias,
            widths,
        }
    }

    /// A gate and an up projection as one SwiGLU product: on flex with AVX-512F or AVX2
    /// (`f32`, no biases) [`FusedLinear::forward_all`] returns `silu(x · gateᵀ) ⊙ (x · upᵀ)`
    /// directly ([`miles_ops::packed::PackedMatrix::glu`], or
    /// [`miles_ops::rows::RowsMatrix::glu`] over the two weights in place); elsewhere the two
    /// stacked as [`FusedLinear::new`] does ([`FusedLinear::is_glu`] tells which).
    pub fn glu(gate: &Linear, up: &Linear, decode: DecodeWeights) -> Self {
        if gate.bias.is_none() && up.bias.is_none() {
            let (g, u) = (gate.effective_weight(), up.effective_weight());
            let fused = packs(decode)
                .then(|| miles_ops::packed::PackedMatrix::glu(g.clone(), u.clone()))
                .flatten()
                .map(|p| (p.n, FusedWeight::Packed(p)))
                .or_else(|| {
                    miles_ops::rows::RowsMatrix::glu(g, u).map(|r| (r.n, FusedWeight::Rows(r)))
                });
            if let Some((n, weight)) = fused {
                return Self {
                    widths: vec![n],
                    weight,
                    bias: None,
                };
            }
        }
        Self::new(&[gate, up], decode)
    }

    /// Whether [`FusedLinear::forward_all`] returns SwiGLU activations ([`FusedLinear::glu`]).
    pub fn is_glu(&self) -> bool {
        use miles_ops::packed::Product;
        match &self.weight {
            FusedWeight::Packed(p) => p.product == Product::Glu,
            FusedWeight::Rows(r) => r.product == Product::Glu,
            FusedWeight::Hf(_) | FusedWeight::Transposed(_) => false,
        }
    }

    /// One layer without bias over `weight` `[out, in]` (e.g. tied embeddings as `lm_head`).
    pub fn from_weight(weight: Tensor<2>, decode: DecodeWeights) -> Self {
        let widths = vec![weight.dims()[0]];
        let device = weight.device();
        let weight = if !miles_ops::device::is_flex(&device) {
            FusedWeight::Hf(weight)
        } else if let Some(packed) = packs(decode)
            .then(|| miles_ops::packed::PackedMatrix::new(weight.clone()))
            .flatten()
        {
            FusedWeight::Packed(packed)
        } else if let Some(rows) = miles_ops::rows::RowsMatrix::new(weight.clone()) {
            FusedWeight::Rows(rows)
        } else {
            // A contiguous copy of the transposed view (one per weight version), in the
            // weight's own dtype.
            let dtype = weight.dtype();
            FusedWeight::Transposed(Tensor::from_data(
                weight.transpose().into_data(),
                (&device, dtype),
            ))
        };
        Self {
            weight,
            bias: None,
            widths,
        }
    }

    /// All outputs side by side, `[tokens, Σ out]`, for `[tokens, in]` rows: one matmul
    /// (the packed or in-place kernel, or split over both cores on flex at decode row counts
    /// or when small, [`miles_ops::linear_t`]).
    pub fn forward_all(&self, x: Tensor<2>) -> Tensor<2> {
        let y = match &self.weight {
            FusedWeight::Packed(packed) => packed.matmul(x),
            FusedWeight::Rows(rows) => rows.matmul(x),
            FusedWeight::Transposed(wt) => miles_ops::linear_t(x, wt.clone()),
            FusedWeight::Hf(w) if miles_ops::runs_amx(w) => miles_ops::linear_bf16(x, w.clone()),
            FusedWeight::Hf(w) => miles_ops::linear(x, w.clone()),
        };
        match &self.bias {
            Some(bias) => y + bias.clone().unsqueeze_dim(0),
            None => y,
        }
    }

    /// The fused layers' outputs for `[tokens, in]` rows, one `[tokens, out_i]` each.
    pub fn forward(&self, x: Tensor<2>) -> Vec<Tensor<2>> {
        let y = self.forward_all(x);
        if self.widths.len() == 1 {
            return vec![y];
        }
        let mut start = 0;
        self.widths
            .iter()
            .map(|&n| {
                let part = y.clone().narrow(1, start, n);
                start += n;
                part
            })
            .collect()
    }
}

/// Whether `decode` lets a [`FusedLinear`] try the packed panels first.
fn packs(decode: DecodeWeights) -> bool {
    decode == DecodeWeights::Packed
}
