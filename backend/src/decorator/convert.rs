//! Moving values between `Parallel<B>` and `B` whose types name the backend itself.
//!
//! Most op signatures use aliases of the backend's primitives (`FloatTensor<B>` is
//! `B::FloatTensorPrimitive`), which `Parallel<B>` shares with `B`, so they pass through as they
//! are. A few types are generic over the backend (`TensorPrimitive<B>`, the max-pool outputs, …):
//! the same fields, a different type. [`Rewrap`] rebuilds them field by field, at no cost.

use burn::tensor::TensorPrimitive;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitive,
};
use burn::tensor::quantization::QuantizationParametersPrimitive;

use super::Parallel;

/// The same value, typed for the other side of the decorator.
pub(crate) trait Rewrap<T> {
    fn rewrap(self) -> T;
}

/// Implements [`Rewrap`] both ways for a struct whose fields are backend primitives.
macro_rules! rewrap_struct {
    ($ty:ident { $($field:ident),* }) => {
        impl<B: Backend> Rewrap<$ty<B>> for $ty<Parallel<B>> {
            fn rewrap(self) -> $ty<B> {
                $ty { $($field: self.$field),* }
            }
        }
        impl<B: Backend> Rewrap<$ty<Parallel<B>>> for $ty<B> {
            fn rewrap(self) -> $ty<Parallel<B>> {
                $ty { $($field: self.$field),* }
            }
        }
    };
}

rewrap_struct!(MaxPool1dWithIndices { output, indices });
rewrap_struct!(MaxPool2dWithIndices { output, indices });
rewrap_struct!(MaxPool1dBackward { x_grad });
rewrap_struct!(MaxPool2dBackward { x_grad });
rewrap_struct!(DeformConv2dBackward {
    x_grad,
    offset_grad,
    weight_grad,
    mask_grad,
    bias_grad
});
rewrap_struct!(QuantizationParametersPrimitive { scales });

impl<B: Backend> Rewrap<TensorPrimitive<B>> for TensorPrimitive<Parallel<B>> {
    fn rewrap(self) -> TensorPrimitive<B> {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
            TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
        }
    }
}

impl<B: Backend> Rewrap<TensorPrimitive<Parallel<B>>> for TensorPrimitive<B> {
    fn rewrap(self) -> TensorPrimitive<Parallel<B>> {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
            TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
        }
    }
}

impl<B: Backend> Rewrap<TransactionPrimitive<B>> for TransactionPrimitive<Parallel<B>> {
    /// The read order is not carried over: `TransactionPrimitive::execute_async` takes it out
    /// before it calls `tr_execute`, so it is always empty here.
    fn rewrap(self) -> TransactionPrimitive<B> {
        TransactionPrimitive::new(
            self.read_floats,
            self.read_qfloats,
            self.read_ints,
            self.read_bools,
        )
    }
}
