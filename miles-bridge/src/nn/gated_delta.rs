//! Qwen3.5's linear attention: the Gated DeltaNet layer ([`GatedDeltaNet`]) and the state it
//! carries between decoding steps ([`LinearState`]).
//!
//! Per token `t` and value head `h` (transformers 5.24's `Qwen3_5GatedDeltaNet`): the fused
//! `in_proj_qkv` output goes through a causal depthwise conv1d (`linear_conv_kernel_dim` taps,
//! no bias) and SiLU, and splits into queries, keys (`linear_num_key_heads`, each shared by
//! `linear_num_value_heads / linear_num_key_heads` consecutive value heads) and values; q and
//! k are L2-normalised (`x / sqrt(Σx² + 1e-6)`) and q scaled by `key_head_dim^-1/2`;
//! `β = sigmoid(in_proj_b x)`, the decay `g = -exp(A_log) · softplus(in_proj_a x + dt_bias)`.
//! The state `S` (`[key_head_dim, value_head_dim]` per head) follows the gated delta rule
//! `S ← e^g S;  S ← S + k (β (v − kᵀS))ᵀ`, the output is `qᵀS`; it goes through an RMSNorm
//! (plain weight, `rms_norm_eps`) gated by `silu(in_proj_z x)` and `out_proj`.
//!
//! The rule itself is miles-ops': training, scoring, prefill and recomputed layers (more than
//! one token) run the **chunked** op ([`miles_ops::gated_delta_rule_chunked`]: the sequence
//! cut into chunks of 64 tokens; within a chunk the delta-rule updates become one
//! unit-lower-triangular system; the chunks scanned in order; on flex native loops with a
//! custom backward, elsewhere the differentiable tensor-op form), one function so that
//! scoring and recomputed layers equal the training forward bit for bit; a decode step (one
//! token) runs the recurrent forward op ([`miles_ops::gated_delta_rule`]: a native loop on
//! flex, a CubeCL kernel on CubeCL devices; without a gradient). Both take the key heads as
//! they are (each serving a group of value heads). It runs in f32 whatever the model's
//! precision, as transformers does.

use burn::module::{Module, Param};
use burn::tensor::activation::{sigmoid, silu, softplus};
use burn::tensor::{Bool, DType, FloatDType, Tensor};

use crate::config::LinearAttentionConfig;
use crate::error::BridgeError;
use crate::nn::linear::{DecodeWeights, FusedLinear, Linear};
use crate::nn::norm::RmsNorm;
use crate::nn::param::{Builder, Init, ParamRef, ParamVisitor};
use crate::profile::{self, OpClass};

pub use miles_ops::DELTA_CHUNK;

/// What a Gated DeltaNet layer keeps between decoding steps, for a batch of rows.
#[derive(Debug, Clone)]
pub struct LinearState {
    /// The conv's window: the last `linear_conv_kernel_dim - 1` inputs of `in_proj_qkv`,
    /// `[batch, kernel - 1, conv_dim]` (zeros before the first token).
    pub conv: Tensor<3>,
    /// The delta-rule state `S`, `[batch, value_heads, key_head_dim, value_head_dim]`, f32.
    pub recurrent: Tensor<4>,
}

impl LinearState {
    /// The state of the given rows (`index`: row numbers), in that order.
    pub(crate) fn select(&self, index: Tensor<1, burn::tensor::Int>) -> Self {
        Self {
            conv: self.conv.clone().select(0, index.clone()),
            recurrent: self.recurrent.clone().select(0, index),
        }
    }

    /// Rows of several states stacked.
    pub(crate) fn cat(parts: Vec<Self>) -> Self {
        let (conv, recurrent): (Vec<_>, Vec<_>) =
            parts.into_iter().map(|s| (s.conv, s.recurrent)).unzip();
        Self {
            conv: Tensor::cat(conv, 0),
            recurrent: Tensor::cat(recurrent, 0),
        }
    }
}

/// The delta rule of one sequence of `q`, `k` `[1, key_heads, t, dk]`, `v` `[1, heads, t,
/// dv]`, `decay`, `beta` `[1, heads, t]` as [`GatedDeltaNet::forward`] runs it: the chunked
/// op for more than one token, the recurrent one for a single token (a decode step).
fn delta_rule(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    decay: Tensor<3>,
    beta: Tensor<3>,
    initial: Option<Tensor<4>>,
) -> (Tensor<4>, Tensor<4>) {
    let seq = q.dims()[2];
    // Training, scoring, prefill and recomputed layers run the one chunked op, so that the
    // trainer's scoring function (the rollout's log-probs) and a recomputed layer compute bit
    // for bit what the training forward computes; a decode step the recurrent op. Shapes are
    // ours: the fallback on an error only re-raises burn's own panic.
    let run = if seq > 1 {
        miles_ops::gated_delta_rule_chunked
    } else {
        miles_ops::gated_delta_rule
    };
    run(
        q.clone(),
        k.clone(),
        v.clone(),
        decay.clone(),
        beta.clone(),
        initial.clone(),
    )
    .unwrap_or_else(|_| miles_ops::gated_delta_rule_reference(q, k, v, decay, beta, initial))
}

/// The delta rule of a right-padded batch, row `r` over its first `lens[r]` tokens only (one
/// [`delta_rule`] per row: what the row's own forward runs): the outputs `[batch, heads, seq,
/// dv]` (zeros at padded positions) and each row's state after its last real token.
fn ragged_delta_rule(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    decay: Tensor<3>,
    beta: Tensor<3>,
    initial: Option<Tensor<4>>,
    lens: &[usize],
) -> (Tensor<4>, Tensor<4>) {
    let [_, heads, seq, dv] = v.dims();
    let device = v.device();
    let (outs, states): (Vec<_>, Vec<_>) = lens
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            let row4 = |t: &Tensor<4>| t.clone().narrow(0, r, 1).narrow(2, 0, n);
            let row3 = |t: &Tensor<3>| t.clone().narrow(0, r, 1).narrow(2, 0, n);
            let init = initial.as_ref().map(|s| s.clone().narrow(0, r, 1));
            let (out, state) = delta_rule(
                row4(&q),
                row4(&k),
                row4(&v),
                row3(&decay),
                row3(&beta),
                init,
            );
            let out = if n < seq {
                Tensor::cat(
                    vec![out, Tensor::zeros([1, heads, seq - n, dv], &device)],
                    2,
                )
            } else {
                out
            };
            (out, state)
        })
        .unzip();
    (Tensor::cat(outs, 0), Tensor::cat(states, 0))
}

/// Qwen3.5's Gated DeltaNet linear-attention layer (`linear_attn`), with HF's parameter names
/// and layouts (see the module docs for the computation).
#[derive(Module, Debug)]
pub struct GatedDeltaNet {
    /// `in_proj_qkv`: `[2·key_dim + value_dim, hidden]`, rows q, k, v.
    pub in_proj_qkv: Linear,
    /// `in_proj_z`: the output gate, `[value_dim, hidden]`.
    pub in_proj_z: Linear,
    /// `in_proj_b`: β before its sigmoid, `[value_heads, hidden]`.
    pub in_proj_b: Linear,
    /// `in_proj_a`: the decay's input, `[value_heads, hidden]`.
    pub in_proj_a: Linear,
    /// `conv1d.weight`: `[conv_dim, 1, kernel]` (depthwise, no bias).
    pub conv1d: Param<Tensor<3>>,
    /// `dt_bias`, `[value_heads]`.
    pub dt_bias: Param<Tensor<1>>,
    /// `A_log`, `[value_heads]`.
    pub a_log: Param<Tensor<1>>,
    /// `norm`: the gated RMSNorm over each head's `value_head_dim` channels (plain weight).
    pub norm: RmsNorm,
    /// `out_proj`: `[hidden, value_dim]`.
    pub out_proj: Linear,
    /// `linear_num_key_heads`.
    pub num_key_heads: usize,
    /// `linear_num_value_heads`.
    pub num_value_heads: usize,
    /// `linear_key_head_dim`.
    pub key_head_dim: usize,
    /// `linear_value_head_dim`.
    pub value_head_dim: usize,
    /// `linear_conv_kernel_dim`.
    pub kernel: usize,
    /// Inference only: `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` as one
    /// matmul ([`FusedLinear`]: the packed decode kernel on flex with AVX-512F); `None` runs
    /// them separately.
    #[module(skip)]
    pub fused_in: Option<FusedLinear>,
    /// Inference only: `out_proj` through [`FusedLinear`].
    #[module(skip)]
    pub packed_out: Option<FusedLinear>,
}

impl GatedDeltaNet {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        hidden: usize,
        c: LinearAttentionConfig,
        eps: f64,
    ) -> Result<Self, BridgeError> {
        let key_dim = c.num_key_heads * c.key_head_dim;
        let value_dim = c.num_value_heads * c.value_head_dim;
        let conv_dim = c.conv_dim();
        let lin = |b: &mut Builder<'_>, part: &str, out: usize| {
            Linear::build(b, &format!("{name}.{part}"), hidden, out, false)
        };
        Ok(Self {
            in_proj_qkv: lin(b, "in_proj_qkv", 2 * key_dim + value_dim)?,
            in_proj_z: lin(b, "in_proj_z", value_dim)?,
            in_proj_b: lin(b, "in_proj_b", c.num_value_heads)?,
            in_proj_a: lin(b, "in_proj_a", c.num_value_heads)?,
            conv1d: b.param(
                &format!("{name}.conv1d.weight"),
                [conv_dim, 1, c.conv_kernel_dim],
                Init::Normal,
            )?,
            dt_bias: b.param(&format!("{name}.dt_bias"), [c.num_value_heads], Init::Ones)?,
            a_log: b.param(&format!("{name}.A_log"), [c.num_value_heads], Init::Zeros)?,
            norm: RmsNorm::build(b, &format!("{name}.norm"), c.value_head_dim, eps)?,
            out_proj: Linear::build(b, &format!("{name}.out_proj"), value_dim, hidden, false)?,
            num_key_heads: c.num_key_heads,
            num_value_heads: c.num_value_heads,
            key_head_dim: c.key_head_dim,
            value_head_dim: c.value_head_dim,
            kernel: c.conv_kernel_dim,
            fused_in: None,
            packed_out: None,
        })
    }

    /// Stacks the input projections into one [`FusedLinear`] and puts `out_proj` through
    /// one, for inference on weights that no longer change (`CausalLm::fuse_projections`).
    pub(crate) fn fuse(&mut self, decode: DecodeWeights) {
        self.fused_in = Some(FusedLinear::new(
            &[
                &self.in_proj_qkv,
                &self.in_proj_z,
                &self.in_proj_b,
                &self.in_proj_a,
            ],
            decode,
        ));
        self.packed_out = Some(FusedLinear::new(&[&self.out_proj], decode));
    }

    fn conv_dim(&self) -> usize {
        2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
    }

    /// The layer over `x` (`[batch, seq, hidden]`). `valid` (`[batch, seq]`, false =
    /// padding) zeroes padded inputs as transformers does, which leaves a state that starts
    /// at zero untouched by left padding. With `state`, the step starts from the state in it
    /// (zeros when empty) and leaves the state after its last token there; a one-token step
    /// runs the recurrent form and keeps the state of rows whose token is padding unchanged.
    pub fn forward(
        &self,
        x: Tensor<3>,
        valid: Option<Tensor<2, Bool>>,
        state: Option<&mut Option<LinearState>>,
    ) -> Tensor<3> {
        self.forward_rows(x, valid, None, state)
    }

    /// [`Self::forward`] over a right-padded batch of sequences of different lengths (a
    /// batched prefill): row `r` holds `lens[r]` real tokens (each in `1..=seq`), the rest
    /// padding. Each row's conv window and delta rule run over its real tokens only — the
    /// delta rule one call per row on exactly the inputs a forward of that row alone gives
    /// it (the chunked op for more than one token, the recurrent one for one), so a row's
    /// outputs and state equal its own forward's bit for bit given the same projections —
    /// and `state` holds each row's state after its last real token. Outputs at padded
    /// positions are those of zero delta-rule outputs (never to be read).
    pub fn forward_ragged(
        &self,
        x: Tensor<3>,
        lens: &[usize],
        state: Option<&mut Option<LinearState>>,
    ) -> Tensor<3> {
        let [_, seq, _] = x.dims();
        let ragged = lens.iter().any(|&n| n != seq);
        self.forward_rows(x, None, ragged.then_some(lens), state)
    }

    fn forward_rows(
        &self,
        x: Tensor<3>,
        valid: Option<Tensor<2, Bool>>,
        lens: Option<&[usize]>,
        state: Option<&mut Option<LinearState>>,
    ) -> Tensor<3> {
        let [batch, seq, hidden] = x.dims();
        let dtype = x.dtype();
        let device = x.device();
        let x = match &valid {
            Some(v) => x * v.clone().float().cast(dtype).unsqueeze_dim::<3>(2),
            None => x,
        };
        let rows = x.reshape([batch * seq, hidden]);
        let (nk, nv, dk, dv) = (
            self.num_key_heads,
            self.num_value_heads,
            self.key_head_dim,
            self.value_head_dim,
        );
        let conv_dim = self.conv_dim();
        let (qkv, z, b, a) = profile::time(OpClass::QkvProj, || {
            let parts = match &self.fused_in {
                Some(fused) => fused.forward(rows),
                None => vec![
                    self.in_proj_qkv.forward(rows.clone()),
                    self.in_proj_z.forward(rows.clone()),
                    self.in_proj_b.forward(rows.clone()),
                    self.in_proj_a.forward(rows),
                ],
            };
            let mut parts = parts.into_iter();
            match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some(qkv), Some(z), Some(b), Some(a)) => {
                    (qkv.reshape([batch, seq, conv_dim]), z, b, a)
                }
                // Four layers in both arms above, so this never runs.
                _ => unreachable!("four input projections"),
            }
        });
        let previous = state.as_ref().and_then(|s| s.as_ref()).cloned();
        let (mixed, conv_window) = profile::time(OpClass::LinearConv, || {
            let past = match &previous {
                Some(s) => s.conv.clone(),
                None => Tensor::<3>::zeros([batch, self.kernel - 1, conv_dim], (&device, dtype)),
            };
            let padded = Tensor::cat(vec![past, qkv], 1);
            let weight = self.conv1d.val().reshape([conv_dim, self.kernel]);
            let mut out = padded.clone().narrow(1, 0, seq)
                * weight.clone().narrow(1, 0, 1).reshape([1, 1, conv_dim]);
            for j in 1..self.kernel {
                out = out
                    + padded.clone().narrow(1, j, seq)
                        * weight.clone().narrow(1, j, 1).reshape([1, 1, conv_dim]);
            }
            // The window after each row's last real token.
            let window = match lens {
                None => padded.narrow(1, seq, self.kernel - 1),
                Some(lens) => Tensor::cat(
                    lens.iter()
                        .enumerate()
                        .map(|(r, &n)| padded.clone().narrow(0, r, 1).narrow(1, n, self.kernel - 1))
                        .collect(),
                    0,
                ),
            };
            (silu(out), window)
        });
        let f32 = FloatDType::F32;
        let key_dim = nk * dk;
        let heads = |t: Tensor<3>, h: usize, d: usize| -> Tensor<4> {
            t.cast(f32).reshape([batch, seq, h, d])
        };
        let q = heads(mixed.clone().narrow(2, 0, key_dim), nk, dk);
        let k = heads(mixed.clone().narrow(2, key_dim, key_dim), nk, dk);
        let v = heads(mixed.narrow(2, 2 * key_dim, nv * dv), nv, dv);
        let l2 = |t: Tensor<4>| -> Tensor<4> {
            let inv = (t.clone().square().sum_dim(3) + 1e-6).sqrt().recip();
            t * inv
        };
        let scale = (dk as f64).powf(-0.5);
        // Each key head serves `nv / nk` consecutive value heads: the ops take the key heads
        // as they are.
        let q = (l2(q) * scale).swap_dims(1, 2);
        let k = l2(k).swap_dims(1, 2);
        let v = v.swap_dims(1, 2);
        let per_head =
            |t: Tensor<2>| -> Tensor<3> { t.cast(f32).reshape([batch, seq, nv]).swap_dims(1, 2) };
        let beta = sigmoid(per_head(b));
        let decay = {
            let a = per_head(a) + self.dt_bias.val().cast(f32).reshape([1, nv, 1]);
            softplus(a, 1.0) * self.a_log.val().cast(f32).exp().reshape([1, nv, 1]).neg()
        };
        let initial = previous.as_ref().map(|s| s.recurrent.clone());
        let (out, last) = profile::time(OpClass::DeltaRule, || {
            if let Some(lens) = lens {
                return ragged_delta_rule(q, k, v, decay, beta, initial, lens);
            }
            delta_rule(q, k, v, decay, beta, initial)
        });
        if let Some(slot) = state {
            let mut next = LinearState {
                conv: conv_window,
                recurrent: last,
            };
            // A padded token of a decode step leaves its row's state as it was.
            if let (Some(valid), Some(old), 1) = (&valid, &previous, seq) {
                let keep = valid.clone().bool_not();
                let (conv_dims, state_dims) = (old.conv.dims(), old.recurrent.dims());
                next.conv = next.conv.mask_where(
                    keep.clone().reshape([batch, 1, 1]).expand(conv_dims),
                    old.conv.clone(),
                );
                next.recurrent = next.recurrent.mask_where(
                    keep.reshape([batch, 1, 1, 1]).expand(state_dims),
                    old.recurrent.clone(),
                );
            }
            *slot = Some(next);
        }
        // `[batch, heads, seq, dv]` → per (token, head) rows for the gated norm.
        let out = out
            .swap_dims(1, 2)
            .cast(dtype)
            .reshape([batch * seq * nv, dv]);
        let gate = z.reshape([batch * seq * nv, dv]);
        profile::time(OpClass::OProj, || {
            let normed = if dtype == DType::F32 {
                self.norm.forward(out) * silu(gate)
            } else {
                // transformers: the norm's output in the compute dtype times the weight, then
                // the gate in f32, rounded once.
                (self.norm.forward(out).cast(f32) * silu(gate.cast(f32))).cast(dtype)
            };
            let normed = normed.reshape([batch * seq, nv * dv]);
            match &self.packed_out {
                Some(out) => out.forward_all(normed),
                None => self.out_proj.forward(normed),
            }
            .reshape([batch, seq, hidden])
        })
    }

    /// Every linear layer with its name relative to `linear_attn`, in a fixed order.
    pub(crate) fn linears(&self) -> Vec<(&'static str, &Linear)> {
        vec![
            ("in_proj_qkv", &self.in_proj_qkv),
            ("in_proj_z", &self.in_proj_z),
            ("in_proj_b", &self.in_proj_b),
            ("in_proj_a", &self.in_proj_a),
            ("out_proj", &self.out_proj),
        ]
    }

    /// Mutable twin of [`Self::linears`] (same order).
    pub(crate) fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        vec![
            ("in_proj_qkv", &mut self.in_proj_qkv),
            ("in_proj_z", &mut self.in_proj_z),
            ("in_proj_b", &mut self.in_proj_b),
            ("in_proj_a", &mut self.in_proj_a),
            ("out_proj", &mut self.out_proj),
        ]
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        f(&format!("{name}.A_log"), ParamRef::R1(&self.a_log));
        f(&format!("{name}.conv1d.weight"), ParamRef::R3(&self.conv1d));
        f(&format!("{name}.dt_bias"), ParamRef::R1(&self.dt_bias));
        self.in_proj_a.visit(&format!("{name}.in_proj_a"), f);
        self.in_proj_b.visit(&format!("{name}.in_proj_b"), f);
        self.in_proj_qkv.visit(&format!("{name}.in_proj_qkv"), f);
        self.in_proj_z.visit(&format!("{name}.in_proj_z"), f);
        self.norm.visit(&format!("{name}.norm"), f);
        self.out_proj.visit(&format!("{name}.out_proj"), f);
    }
}
