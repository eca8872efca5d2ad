//! AdamW against `torch.optim.AdamW`: three steps on two parameters, every value compared.
//!
//! Expected values: torch 2.15, `torch.optim.AdamW([w, b], lr=1e-2, betas=(0.9, 0.98),
//! eps=1e-8, weight_decay=0.1, foreach=False, fused=False)`, float32, the gradients set by
//! `loss = (w * gw).sum() + (b * gb).sum()` (so `∂loss/∂w = gw`), printed after each
//! `opt.step()` as `str(numpy.float32(x))` (the shortest decimal that reads back the same
//! `f32`).

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData};
use miles_bridge::nn::{ParamRef, ParamVisitor};
use miles_train::{AdamW, AdamWConfig, GradAccumulator, NamedParams};

#[derive(Module, Debug)]
struct Two {
    w: Param<Tensor<2>>,
    b: Param<Tensor<1>>,
}

impl NamedParams for Two {
    fn visit_named(&self, f: &mut ParamVisitor<'_>) {
        f("w", ParamRef::R2(&self.w));
        f("b", ParamRef::R1(&self.b));
    }
}

const GRADS: [([f32; 6], [f32; 3]); 3] = [
    ([0.2, -0.1, 0.05, 1.0, -0.5, 0.0], [0.3, 0.0, -0.7]),
    ([-0.4, 0.2, 0.05, 0.5, 0.25, -1.0], [0.1, 0.2, 0.3]),
    ([1e-3, -2.0, 0.5, 0.0, 0.0, 0.01], [-0.05, 0.4, 2.0]),
];

const TORCH: [([f32; 6], [f32; 3]); 3] = [
    (
        [0.48950002, -0.23975, 1.4885, -2.0080001, 0.134875, 0.74925],
        [0.0899, -0.29970002, 0.010000002],
    ),
    (
        [
            0.49266106, -0.2431608, 1.4770116, -2.015341, 0.1374112, 0.7559067,
        ],
        [0.081065804, -0.30680624, 0.01322653],
    ),
    (
        [
            0.49498963,
            -0.23693968,
            1.4681959,
            -2.0205874,
            0.13934858,
            0.76083916,
        ],
        [0.075285956, -0.31472218, 0.008166417],
    ),
];

fn close(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        // torch's `lerp_` / `addcmul_` / `addcdiv_` round differently from our products by a
        // few ulp of the moments; the parameters agree to 1e-6 relative.
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
            "{what}[{i}]: {g} vs torch {w}"
        );
    }
}

#[test]
fn adamw_matches_torch_over_three_steps() {
    let device = Device::flex().autodiff();
    let mut model = Two {
        w: Param::from_tensor(Tensor::from_data(
            TensorData::new(vec![0.5f32, -0.25, 1.5, -2.0, 0.125, 0.75], [2, 3]),
            &device,
        )),
        b: Param::from_tensor(Tensor::from_data(
            TensorData::new(vec![0.1f32, -0.3, 0.0], [3]),
            &device,
        )),
    };
    let mut optimizer = AdamW::new(AdamWConfig {
        weight_decay: 0.1,
        adam_beta1: 0.9,
        adam_beta2: 0.98,
        adam_eps: 1e-8,
    });
    for (step, ((gw, gb), (tw, tb))) in GRADS.iter().zip(TORCH.iter()).enumerate() {
        let gw = Tensor::<2>::from_data(TensorData::new(gw.to_vec(), [2, 3]), &device);
        let gb = Tensor::<1>::from_data(TensorData::new(gb.to_vec(), [3]), &device);
        let loss = (model.w.val() * gw).sum() + (model.b.val() * gb).sum();
        let grads = loss.backward();
        let mut acc = GradAccumulator::new();
        acc.accumulate(&model, &grads);
        assert_eq!(acc.len(), 2);
        model = optimizer.step(model, acc, 1e-2);
        let w = model.w.val().into_data().try_to_vec::<f32>().unwrap();
        let b = model.b.val().into_data().try_to_vec::<f32>().unwrap();
        close(&w, tw, &format!("step {} w", step + 1));
        close(&b, tb, &format!("step {} b", step + 1));
    }
    assert_eq!(optimizer.step_count(), 3);
    // The moments are kept by name for checkpoints.
    let state = optimizer.state_tensors();
    assert_eq!(state.len(), 4);
}
