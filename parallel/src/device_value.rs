//! Scalars a training step computes on the device and leaves there: the loss, the gradient
//! norm, the clipping factor. Each is a one-element tensor; the host reads it only when it asks
//! ([`read_value`]).
//!
//! A read waits for every kernel queued before it, so a step that reads a loss or a norm back
//! stops a GPU from running ahead of the host (`wildfire_backend::blocking_reads` counts such
//! reads). Keeping these scalars on the device makes a steady step read nothing; the loop reads
//! them when it logs.
//!
//! Sums of such scalars are kept in the widest float the device computes them in
//! ([`wide_dtype`]): f64 where it has one (Flex, Burn's bare CubeCL backends where the device
//! offers 64-bit floats), f32 elsewhere, which includes Burn's fusion backend (`--device wgpu`
//! and `--device cuda`), whose fusers have no f64. A sum of f32 terms folded in order in f64
//! ([`fold_sum`]) is, bit for bit, what the same fold gives on the host, so moving these sums
//! to the device changes no value where f64 exists. Where it does not, the sum is an f32
//! fold: its relative error is at most about `n · 2⁻²⁴` for `n` non-negative terms, instead of
//! `n · 2⁻⁵³`.

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor};
use wildfire_backend::comm::{CommError, ProcessGroup, ReduceOp};
use wildfire_backend::fusion::is_fused_backend;
use wildfire_backend::host_data::aligned;

/// The widest float `device` computes these sums in: f64 where it has it, outside Burn's
/// fusion backend (whose fusers have no f64: `wildfire_backend::fusion::is_fused_backend`);
/// f32 otherwise.
pub fn wide_dtype<B: Backend>(device: &B::Device) -> FloatDType {
    match B::supports_dtype(device, DType::F64) && !is_fused_backend::<B>() {
        true => FloatDType::F64,
        false => FloatDType::F32,
    }
}

/// `value` (one element) in the device's [`wide_dtype`].
pub fn widened<B: Backend>(value: Tensor<B, 1>) -> Tensor<B, 1> {
    let dtype = wide_dtype::<B>(&value.device());
    value.cast(dtype)
}

/// `((t₀ + t₁) + t₂) + …` in the device's [`wide_dtype`], in the order given (0 when there
/// are no terms).
pub fn fold_sum<B: Backend>(
    terms: impl IntoIterator<Item = Tensor<B, 1>>,
    device: &B::Device,
) -> Tensor<B, 1> {
    terms
        .into_iter()
        .map(widened)
        .reduce(|total, term| total + term)
        .unwrap_or_else(|| Tensor::zeros([1], (device, DType::from(wide_dtype::<B>(device)))))
}

/// The sum of `value` over `group`, on every rank (in rank order; see `ReduceOp`). A group of
/// one has nothing to add, and nothing moves.
pub fn sum_over<B: Backend>(
    group: &ProcessGroup,
    value: Tensor<B, 1>,
) -> Result<Tensor<B, 1>, CommError> {
    match group.size() {
        1 => Ok(value),
        _ => group.all_reduce(value, ReduceOp::Sum),
    }
}

/// The values of one-element tensors `values`, in one blocking read (the tensors are joined on
/// the device first; they must share a dtype).
pub fn read_values<B: Backend>(values: Vec<Tensor<B, 1>>) -> Vec<f64> {
    if values.is_empty() {
        return Vec::new();
    }
    let data = aligned(Tensor::cat(values, 0).into_data());
    data.iter::<f64>().collect()
}

/// The value of a one-element tensor: one blocking read.
pub fn read_value<B: Backend>(value: Tensor<B, 1>) -> f64 {
    read_values(vec![value])[0]
}

/// The inner backend's device of `module`'s parameters (the default device for a module
/// without any).
pub fn module_inner_device<A: AutodiffBackend, M: AutodiffModule<A>>(
    module: &M,
) -> burn::tensor::Device<A::InnerBackend> {
    inner_device_of::<A>(&module.devices().into_iter().next().unwrap_or_default())
}

/// The inner backend's device that corresponds to `device`.
pub fn inner_device_of<A: AutodiffBackend>(
    device: &A::Device,
) -> burn::tensor::Device<A::InnerBackend> {
    burn::tensor::Tensor::<A, 1>::zeros([1], device)
        .inner()
        .device()
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    use super::*;

    type B = Flex;

    /// Terms whose f32 sum rounds but whose f64 sum does not: the device fold in f64 equals the
    /// host's f64 fold bit for bit.
    #[test]
    fn the_fold_is_the_hosts_f64_fold() {
        let device = Default::default();
        let terms = [1.0f32, 1e-8, 3.0e7, 0.1, 7.25e-3];
        let on_device = fold_sum(
            terms.map(|t| Tensor::<B, 1>::from_data(TensorData::from([t]), &device)),
            &device,
        );
        assert_eq!(on_device.dtype(), DType::F64);
        let on_host = terms.iter().fold(0.0f64, |total, &t| total + f64::from(t));
        assert_eq!(read_value(on_device).to_bits(), on_host.to_bits());
        let empty = fold_sum(Vec::<Tensor<B, 1>>::new(), &device);
        assert_eq!(read_value(empty), 0.0);
    }

    #[test]
    fn values_are_read_together_and_keep_nan() {
        let device = Default::default();
        let values = [2.5f32, f32::NAN, -1.0]
            .map(|v| widened(Tensor::<B, 1>::from_data(TensorData::from([v]), &device)));
        let read = read_values(values.to_vec());
        assert_eq!(read.len(), 3);
        assert_eq!(read[0], 2.5);
        assert!(read[1].is_nan());
        assert_eq!(read[2], -1.0);
    }
}
