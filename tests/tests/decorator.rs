//! `Parallel<B>` changes nothing by itself: training on `Autodiff<Parallel<Flex>>` ends with
//! bitwise the same parameters as on `Autodiff<Flex>`.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::activation::relu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use wildfire_backend::Parallel;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    hidden: Linear<B>,
    out: Linear<B>,
}

/// Deterministic, non-symmetric values (no global RNG: tests run in parallel).
fn values(len: usize, salt: u32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| (((i * 2_654_435_761u32) ^ salt) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

fn linear<B: Backend>(d_in: usize, d_out: usize, salt: u32, device: &B::Device) -> Linear<B> {
    let weight = Tensor::from_data(
        TensorData::new(values(d_in * d_out, salt), [d_in, d_out]),
        device,
    );
    let bias = Tensor::from_data(TensorData::new(values(d_out, salt + 1), [d_out]), device);
    Linear {
        weight: Param::from_tensor(weight),
        bias: Some(Param::from_tensor(bias)),
    }
}

/// Five Adam steps on a small regression; returns every parameter's bits.
fn train<B: AutodiffBackend>() -> Vec<u32> {
    let device = Default::default();
    let mut model = Mlp::<B> {
        hidden: linear(8, 16, 7, &device),
        out: linear(16, 4, 11, &device),
    };
    let mut optim = AdamConfig::new().init();
    let x = Tensor::<B, 2>::from_data(TensorData::new(values(32 * 8, 3), [32, 8]), &device);
    let y = Tensor::<B, 2>::from_data(TensorData::new(values(32 * 4, 5), [32, 4]), &device);
    for _ in 0..5 {
        let prediction = model.out.forward(relu(model.hidden.forward(x.clone())));
        let loss = (prediction - y.clone()).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    [
        model.hidden.weight.val().into_data(),
        model.hidden.bias.expect("bias").val().into_data(),
        model.out.weight.val().into_data(),
    ]
    .into_iter()
    .flat_map(|d| {
        d.to_vec::<f32>()
            .expect("f32")
            .into_iter()
            .map(f32::to_bits)
    })
    .collect()
}

#[test]
fn training_through_the_decorator_is_bitwise_identical() {
    let bare = train::<Autodiff<Flex>>();
    let decorated = train::<Autodiff<Parallel<Flex>>>();
    assert_eq!(bare.len(), 8 * 16 + 16 + 16 * 4);
    assert_eq!(bare, decorated);
    // And the run did train: parameters moved away from their initial values.
    let initial: Vec<u32> = values(8 * 16, 7).into_iter().map(f32::to_bits).collect();
    assert_ne!(&bare[..initial.len()], &initial[..]);
}
