//! Fused bias + GELU with its fused backward: the MLP's `g(x + b)` after its first matmul, as
//! Megatron-LM's bias-GELU fusion does it (one elementwise pass each way, saving only `x` and
//! `b` for the backward).
//!
//! With `x: [.., n]` (its rows: every index but the last), `b: [n]` broadcast over the rows and
//! `z = x + b`, all computed in f32:
//!
//! ```text
//! y = g(z) = z·s,    s = σ(2u) = 1 / (1 + e^E),    E = −2u = −2c(z + a·z³),    c = √(2/π), a = 0.044715
//! ```
//!
//! which is GPT-2's `½z(1 + tanh u)` (`½(1 + tanh u) = σ(2u)`), with `E` clamped at 80 as in
//! [`super::gelu_tanh_f32`]. **Backward**, given `dy`: from `ds/dz = s(1 − s)·2c(1 + 3a·z²)`,
//!
//! ```text
//! g'(z) = s + z·s(1 − s)·2c(1 + 3a·z²)   where E < 80;   s where the clamp holds E (there the
//!                                                        computed form is constant in E)
//! dx = dy ∘ g'(z)        db = Σ_rows dx
//! ```
//!
//! The autodiff node keeps `x` and `b` only. The decomposed graph of the same computation keeps
//! five tensors of `x`'s size in f32 (`z`, `z²`, `E`, `e^E` and `1 + e^E`), so the fused op
//! lowers the activation memory of a GPT's MLP by about four of its hidden activations per
//! block, and replaces the decomposed forward's and backward's dozen elementwise passes with one
//! kernel each way.
//!
//! `x` in f32, f16 or bf16 comes back in its type; `b` may be in any float type (the GPT passes
//! its fp32 parameter, unrounded). On CubeCL backends the passes are the kernels of [`cube`]
//! (the forward is the matmul's epilogue kernel), on Flex in f32 the loops of [`super::flex`];
//! elsewhere the reference in Burn ops.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, Tensor, TensorMetadata};

use super::flex;
use super::route::{on_cube, on_flex};
use super::{
    GELU_A, GELU_C, GELU_EXPONENT_CLAMP, as_rows, cast_primitive, gelu_exponent, gelu_tanh_f32,
    in_dtype, tensor,
};
use crate::Parallel;
pub use cube::{backward_kernel, forward_kernel};

/// A backend with the fused bias + GELU op (see the module doc): `g(x + b)` on `x: [.., n]` (any
/// rank; the rows are all but the last dim) and `b: [n]`, whose autodiff backward is the fused
/// one.
pub trait FusedBiasGeluBackend: Backend {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `g(x + b)` on `x: [.., n]` (any rank) and `b: [n]`, in `x`'s type (see the module doc).
///
/// # Panics
/// When `b` is not `[n]`, naming both shapes.
pub fn bias_gelu<B: FusedBiasGeluBackend, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
) -> Tensor<B, D> {
    let shape = x.dims();
    let columns = shape[D - 1];
    assert_eq!(
        bias.dims(),
        [columns],
        "bias_gelu: bias {:?} for input {shape:?} (the bias has one value per column)",
        bias.dims()
    );
    let (x, bias) = (x.into_primitive().tensor(), bias.into_primitive().tensor());
    tensor(B::bias_gelu(x, bias))
}

/// The reference forward: `g(x + b)` in f32 with Burn ops, returned in `x`'s type.
pub fn reference_forward<B: Backend>(x: Tensor<B, 2>, bias: Tensor<B, 1>) -> Tensor<B, 2> {
    let dtype = FloatDType::from(x.dtype());
    in_dtype(gelu_tanh_f32(biased(x, bias)), dtype)
}

/// The reference backward: `dx = dy ∘ g'(x + b)`, in f32 (the caller rounds it to `x`'s type
/// and sums it over the rows for `db`).
pub fn reference_backward<B: Backend>(
    x: Tensor<B, 2>,
    bias: Tensor<B, 1>,
    output_grad: Tensor<B, 2>,
) -> Tensor<B, 2> {
    in_dtype(output_grad, FloatDType::F32) * gelu_slope_f32(biased(x, bias))
}

/// `z = x + b` in f32.
fn biased<B: Backend>(x: Tensor<B, 2>, bias: Tensor<B, 1>) -> Tensor<B, 2> {
    in_dtype(x, FloatDType::F32) + in_dtype(bias, FloatDType::F32).unsqueeze()
}

/// `g'(z)` of the clamped form (see the module doc), on an f32 tensor.
fn gelu_slope_f32<B: Backend>(z: Tensor<B, 2>) -> Tensor<B, 2> {
    let exponent = gelu_exponent(z.clone());
    let unclamped = exponent.clone().lower_elem(GELU_EXPONENT_CLAMP).float();
    let s = (exponent.clamp_max(GELU_EXPONENT_CLAMP).exp() + 1.0).recip();
    let growth = z.clone() * z.clone() * (3.0 * GELU_A) + 1.0;
    let slope_of_s = s.clone() * (s.clone().neg() + 1.0) * growth * (2.0 * GELU_C);
    s + z * slope_of_s * unclamped
}

/// `t` (of `[rows, n]`) reshaped to `shape`.
fn reshaped<B: Backend>(t: Tensor<B, 2>, shape: Shape) -> FloatTensor<B> {
    B::float_reshape(t.into_primitive().tensor(), shape)
}

/// The forward on backend `B`: the CubeCL kernel on CubeCL backends and the native loop on Flex
/// (unless opted out), the reference otherwise.
fn forward_on<B: Backend>(x: FloatTensor<B>, bias: FloatTensor<B>) -> FloatTensor<B> {
    let routed = on_cube(&cube::Forward, [x, bias])
        .or_else(|inputs| on_flex(inputs, flex::bias_gelu_forward));
    match routed {
        Ok([y]) => y,
        Err([x, bias]) => {
            let shape = x.shape();
            reshaped(reference_forward::<B>(as_rows(x), tensor(bias)), shape)
        }
    }
}

/// `dx` in f32 on backend `B` from `[x, bias, output_grad]`: the CubeCL kernel on CubeCL
/// backends and the native loop on Flex (unless opted out), the reference otherwise.
fn backward_on<B: Backend>(inputs: [FloatTensor<B>; 3]) -> FloatTensor<B> {
    let routed = on_cube(&cube::Backward, inputs)
        .or_else(|inputs| on_flex(inputs, flex::bias_gelu_backward));
    match routed {
        Ok([grad]) => grad,
        Err([x, bias, output_grad]) => {
            let shape = x.shape();
            let grad = reference_backward::<B>(as_rows(x), tensor(bias), as_rows(output_grad));
            reshaped(grad, shape)
        }
    }
}

/// `db = Σ_rows dx` from `dx: [.., n]` in f32, summed over the leading dims one at a time: a
/// whole layer and a column-parallel part of it sum each column in the same order, so their
/// bias gradients agree bitwise.
fn bias_grad<B: Backend>(grad: FloatTensor<B>, columns: usize) -> FloatTensor<B> {
    let leading = grad.shape().num_dims() - 1;
    let sum = (0..leading).fold(grad, |sum, dim| B::float_sum_dim(sum, dim));
    B::float_reshape(sum, Shape::new([columns]))
}

impl<B: Backend> FusedBiasGeluBackend for Parallel<B> {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        forward_on::<Self>(x, bias)
    }
}

/// The autodiff node of the fused bias + GELU; it keeps `[x, bias]`.
#[derive(Debug)]
struct BiasGeluBackward;

impl<B: Backend> Backward<Parallel<B>, 2> for BiasGeluBackward {
    type State = [FloatTensor<Parallel<B>>; 2];

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let output_grad = grads.consume::<Parallel<B>>(&ops.node);
        let [x, bias] = ops.state;
        let (x_dtype, bias_dtype) = (FloatDType::from(x.dtype()), FloatDType::from(bias.dtype()));
        let columns = bias.shape()[0];
        let grad = backward_on::<Parallel<B>>([x, bias, output_grad]);
        let [x_node, bias_node] = ops.parents;
        if let Some(node) = bias_node {
            let bias_grad = bias_grad::<Parallel<B>>(grad.clone(), columns);
            grads.register::<Parallel<B>>(
                node.id,
                cast_primitive::<Parallel<B>>(bias_grad, bias_dtype),
            );
        }
        if let Some(node) = x_node {
            grads.register::<Parallel<B>>(node.id, cast_primitive::<Parallel<B>>(grad, x_dtype));
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> FusedBiasGeluBackend for Autodiff<Parallel<B>, C> {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [x.node.clone(), bias.node.clone()];
        let (x, bias) = (x.primitive, bias.primitive);
        let y = forward_on::<Parallel<B>>(x.clone(), bias.clone());
        // Compute-bound like a matmul for the checkpointing strategies: the node keeps its
        // inputs rather than asking for them to be recomputed.
        match BiasGeluBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish([x, bias], y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

/// The CubeCL kernels: the forward is the epilogue kernel the mixed-precision matmul also runs
/// after its product; the backward computes `dy ∘ g'(x + b)` in f32 in one pass.
pub(crate) mod cube {
    use burn::tensor::{DType, Shape};
    use burn_cubecl::CubeRuntime;
    use burn_cubecl::kernel::{cast, into_contiguous};
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::calculate_cube_count_elemwise;
    use cubecl::prelude::*;

    use crate::kernels::route::CubeKernel;

    /// GELU's `c`, `a` and exponent clamp in f32 (see the module doc).
    const C: f32 = super::GELU_C as f32;
    const A: f32 = super::GELU_A as f32;
    const CLAMP: f32 = super::GELU_EXPONENT_CLAMP as f32;

    /// GELU's exponent `E = −2c(z + a·z³)`.
    #[cube]
    fn exponent(z: f32) -> f32 {
        -2.0f32 * f32::new(C) * (z + f32::new(A) * z * z * z)
    }

    /// GPT-2's GELU in f32, `z / (1 + e^min(E, 80))` (the form of `gelu_tanh_f32`).
    #[cube]
    fn gelu(z: f32) -> f32 {
        z / (1.0f32 + min(exponent(z), f32::new(CLAMP)).exp())
    }

    /// `g'(z)` of the clamped form (see the module doc).
    #[cube]
    fn gelu_slope(z: f32) -> f32 {
        let e = exponent(z);
        let s = 1.0f32 / (1.0f32 + min(e, f32::new(CLAMP)).exp());
        let mut slope = s;
        if e < f32::new(CLAMP) {
            let growth = 1.0f32 + 3.0f32 * f32::new(A) * z * z;
            slope += z * s * (1.0f32 - s) * 2.0f32 * f32::new(C) * growth;
        }
        slope
    }

    /// One unit per element of `input: [.., columns]`:
    /// `out[i] = O(g(input[i] + bias[i mod columns]))`, the bias and `g` (GELU) each optional.
    #[cube(launch_unchecked)]
    fn epilogue_kernel<I: Float, O: Float>(
        input: &Tensor<I>,
        bias: &Tensor<f32>,
        out: &mut Tensor<O>,
        columns: usize,
        #[comptime] has_bias: bool,
        #[comptime] apply_gelu: bool,
        #[define(I, O)] _dtypes: [StorageType; 2],
    ) {
        let index = ABSOLUTE_POS;
        if index < out.len() {
            let mut value = f32::cast_from(input[index]);
            if has_bias {
                value += bias[index % columns];
            }
            if apply_gelu {
                value = gelu(value);
            }
            out[index] = O::cast_from(value);
        }
    }

    /// One unit per element: `grad[i] = dy[i]·g'(x[i] + bias[i mod columns])`, in f32.
    #[cube(launch_unchecked)]
    fn bias_gelu_grad_kernel<F: Float>(
        x: &Tensor<F>,
        bias: &Tensor<f32>,
        output_grad: &Tensor<F>,
        grad: &mut Tensor<f32>,
        columns: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let index = ABSOLUTE_POS;
        if index < grad.len() {
            let z = f32::cast_from(x[index]) + bias[index % columns];
            grad[index] = f32::cast_from(output_grad[index]) * gelu_slope(z);
        }
    }

    /// An empty contiguous tensor of `shape` and `dtype` on `like`'s device.
    fn empty_like<R: CubeRuntime>(
        like: &CubeTensor<R>,
        shape: Shape,
        dtype: DType,
    ) -> CubeTensor<R> {
        empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
    }

    /// The cube count and cube dim of a launch with one unit per element of `out`.
    fn elementwise_grid<R: CubeRuntime>(out: &CubeTensor<R>) -> (CubeCount, CubeDim) {
        let elements = out.meta.shape().num_elements();
        let cube_dim = CubeDim::new(&out.client, elements);
        let cubes = calculate_cube_count_elemwise(&out.client, elements, cube_dim);
        (cubes, cube_dim)
    }

    /// [`epilogue_kernel`] on `input` (`[.., columns]`, any kernel float type): the bias added
    /// when there is one, then GELU when `gelu`, written in `output`'s type.
    pub(crate) fn epilogue<R: CubeRuntime>(
        input: CubeTensor<R>,
        bias: Option<CubeTensor<R>>,
        columns: usize,
        gelu: bool,
        output: DType,
    ) -> CubeTensor<R> {
        let input = into_contiguous(input);
        let has_bias = bias.is_some();
        // Without a bias the kernel reads none; one element stands in for the binding.
        let bias = match bias {
            Some(bias) => into_contiguous(cast(bias, DType::F32)),
            None => empty_like(&input, Shape::new([1]), DType::F32),
        };
        let out = empty_like(&input, input.meta.shape().clone(), output);
        let client = input.client.clone();
        let (cubes, cube_dim) = elementwise_grid(&out);
        let dtypes = [input.dtype.into(), output.into()];
        // SAFETY: `input` and `out` are contiguous with the same shape, the kernel writes only
        // indices below `out.len()`, and reads `bias` (of `columns` elements, checked by the
        // callers) modulo `columns` only when there is one.
        unsafe {
            epilogue_kernel::launch_unchecked(
                &client,
                cubes,
                cube_dim,
                input.into_tensor_arg(),
                bias.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                columns,
                has_bias,
                gelu,
                dtypes,
            )
        };
        out
    }

    /// The forward kernel on `x: [.., columns]` and `bias: [columns]`: `g(x + b)` in `x`'s
    /// type; or why it does not take them (a dtype outside f32, f16 and bf16 or one the device
    /// lacks, mismatched shapes).
    pub fn forward_kernel<R: CubeRuntime>(
        x: CubeTensor<R>,
        bias: CubeTensor<R>,
    ) -> Result<CubeTensor<R>, String> {
        let columns = checked_columns(&x, &bias, None)?;
        let dtype = x.dtype;
        Ok(epilogue(x, Some(bias), columns, true, dtype))
    }

    /// The backward kernel ([`bias_gelu_grad_kernel`]) on `x: [.., columns]`,
    /// `bias: [columns]` and `output_grad` (`x`'s shape and type): `dy ∘ g'(x + b)` in f32; or
    /// why it does not take them.
    pub fn backward_kernel<R: CubeRuntime>(
        x: CubeTensor<R>,
        bias: CubeTensor<R>,
        output_grad: CubeTensor<R>,
    ) -> Result<CubeTensor<R>, String> {
        let columns = checked_columns(&x, &bias, Some(&output_grad))?;
        let [x, output_grad] = [x, output_grad].map(into_contiguous);
        let bias = into_contiguous(cast(bias, DType::F32));
        let grad = empty_like(&x, x.meta.shape().clone(), DType::F32);
        let client = x.client.clone();
        let (cubes, cube_dim) = elementwise_grid(&grad);
        let dtype = x.dtype.into();
        // SAFETY: `x`, `output_grad` and `grad` are contiguous with the same shape (checked by
        // `checked_columns`), the kernel touches only indices below `grad.len()`, and reads
        // `bias` (of `columns` elements) modulo `columns`.
        unsafe {
            bias_gelu_grad_kernel::launch_unchecked(
                &client,
                cubes,
                cube_dim,
                x.into_tensor_arg(),
                bias.into_tensor_arg(),
                output_grad.into_tensor_arg(),
                grad.clone().into_tensor_arg(),
                columns,
                dtype,
            )
        };
        Ok(grad)
    }

    /// The columns of `x: [.., columns]` once `x`, `bias: [columns]` and any `like_x`
    /// (tensors of `x`'s shape and type) are ones the kernels take; or why they are not.
    fn checked_columns<R: CubeRuntime>(
        x: &CubeTensor<R>,
        bias: &CubeTensor<R>,
        like_x: Option<&CubeTensor<R>>,
    ) -> Result<usize, String> {
        let properties = x.client.properties();
        for dtype in [x.dtype, bias.dtype] {
            if ![DType::F32, DType::F16, DType::BF16].contains(&dtype) {
                return Err(format!("dtype {dtype:?} (f32, f16 and bf16 are supported)"));
            }
            if !properties.supports_type(dtype) {
                return Err(format!("the device has no {dtype:?} arithmetic"));
            }
        }
        let (shape, bias_shape) = (x.meta.shape(), bias.meta.shape());
        let columns = shape[shape.num_dims() - 1];
        if bias_shape.num_dims() != 1 || bias_shape[0] != columns || shape.num_elements() == 0 {
            return Err(format!("input {shape:?} with bias {bias_shape:?}"));
        }
        if let Some(other) = like_x
            && (other.meta.shape() != shape || other.dtype != x.dtype)
        {
            return Err(format!(
                "gradient {:?} {:?} for input {shape:?} {:?}",
                other.meta.shape(),
                other.dtype,
                x.dtype
            ));
        }
        Ok(columns)
    }

    /// A kernel's output for the router: `None` (logged) sends the call to the reference.
    fn routed<R: CubeRuntime>(result: Result<CubeTensor<R>, String>) -> Option<[CubeTensor<R>; 1]> {
        result
            .inspect_err(|reason| log::debug!("bias + GELU runs the reference: {reason}"))
            .ok()
            .map(|out| [out])
    }

    /// [`forward_kernel`] for the router.
    pub(super) struct Forward;

    impl CubeKernel<2, 1> for Forward {
        fn launch<R: CubeRuntime>(
            &self,
            [x, bias]: [CubeTensor<R>; 2],
        ) -> Option<[CubeTensor<R>; 1]> {
            routed(forward_kernel(x, bias))
        }
    }

    /// [`backward_kernel`] for the router.
    pub(super) struct Backward;

    impl CubeKernel<3, 1> for Backward {
        fn launch<R: CubeRuntime>(
            &self,
            [x, bias, output_grad]: [CubeTensor<R>; 3],
        ) -> Option<[CubeTensor<R>; 1]> {
            routed(backward_kernel(x, bias, output_grad))
        }
    }
}
