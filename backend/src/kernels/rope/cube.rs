//! The CubeCL kernel of the rotary embedding ([`super`]'s op), one unit per element, in the
//! input's type: `y = x·cos + b·sin` with `b` the element's partner in the other half of its
//! head, negated in the first half (`rot(x₁, x₂) = (−x₂, x₁)`).

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_kernel::{CubeKernel, TensorSpec, unsupported_float};
use crate::kernels::launch::{accepted, elementwise_grid, empty_like};

/// One unit per element of `x: [batch, seq, heads, width]` (contiguous): element `(·, p, ·, c)`
/// reads row `p` of the `[seq, width]` tables at column `c`.
#[cube(launch_unchecked)]
fn rope_elementwise<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    out: &mut Tensor<F>,
    seq: usize,
    heads: usize,
    width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let index = ABSOLUTE_POS;
    if index < out.len() {
        let half = width / 2;
        let column = index % width;
        let position = (index / (width * heads)) % seq;
        let table = position * width + column;
        let mut rotated = x[index - half];
        if column < half {
            rotated = -x[index + half];
        }
        out[index] = x[index] * cos[table] + rotated * sin[table];
    }
}

/// Why the kernel does not take `x: [batch, seq, heads, width]` and tables `[seq, width]` of
/// these shapes and types on `device`, if it does not: they must be of one type, f32, f16 or
/// bf16 on a device that has it, `x` non-empty and `width` even.
fn unsupported<R: CubeRuntime>(
    [x, cos, sin]: &[TensorSpec; 3],
    device: &R::Device,
) -> Result<(), String> {
    let (shape, dtype) = (&x.shape, x.dtype);
    if shape.num_dims() != 4 || shape.num_elements() == 0 {
        return Err(format!(
            "input {shape:?} (a non-empty [batch, seq, heads, width])"
        ));
    }
    let (seq, width) = (shape[1], shape[3]);
    if !width.is_multiple_of(2) {
        return Err(format!("heads of odd width {width}"));
    }
    unsupported_float::<R>(dtype, device)?;
    let table = TensorSpec::new(Shape::new([seq, width]), dtype);
    for other in [cos, sin] {
        if *other != table {
            return Err(format!(
                "table {:?} {:?} for input {shape:?} {dtype:?}",
                other.shape, other.dtype
            ));
        }
    }
    Ok(())
}

/// The kernel on `x: [batch, seq, heads, width]` and tables `[seq, width]` (one type, f32, f16
/// or bf16 on a device that has it; `width` even): the rotated `x`; or why it does not take them.
pub fn rope_kernel<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
) -> Result<CubeTensor<R>, String> {
    unsupported::<R>(&[&x, &cos, &sin].map(TensorSpec::of), &x.device)?;
    let [_, seq, heads, width] = x.meta.shape().dims::<4>();
    let dtype = x.dtype;
    let [x, cos, sin] = [x, cos, sin].map(into_contiguous);
    let client = x.client.clone();
    let out = empty_like(&x);
    let (cubes, cube_dim) = elementwise_grid(&out);
    // SAFETY: `x` and `out` are contiguous of one shape and the tables contiguous `[seq,
    // width]` (checked); each unit below `out.len()` reads its partner `half` away inside its
    // own head and the tables inside row `position < seq`.
    unsafe {
        rope_elementwise::launch_unchecked(
            &client,
            cubes,
            cube_dim,
            x.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            seq,
            heads,
            width,
            dtype.into(),
        )
    };
    Ok(out)
}

/// [`rope_kernel`] for the router.
#[derive(Clone, Debug)]
pub(super) struct Rope;

impl CubeKernel<3, 1> for Rope {
    fn op(&self) -> &'static str {
        "rope"
    }

    fn outputs<R: CubeRuntime>(
        &self,
        inputs: &[TensorSpec; 3],
        device: &R::Device,
    ) -> Result<[TensorSpec; 1], String> {
        unsupported::<R>(inputs, device)?;
        Ok([inputs[0].clone()])
    }

    fn launch<R: CubeRuntime>(&self, [x, cos, sin]: [CubeTensor<R>; 3]) -> [CubeTensor<R>; 1] {
        [accepted(self.op(), rope_kernel(x, cos, sin))]
    }
}
