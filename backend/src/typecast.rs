//! Choosing a path by type without specialisation: a value of a generic type `A` is taken as a
//! concrete `T` when the two are the same type. The NCCL transport and the CubeCL kernels route
//! a backend's tensor primitives this way.

use std::any::Any;

/// `value` as a `T`, when `A` is `T`; otherwise `value` back.
pub(crate) fn cast<A: 'static, T: 'static>(value: A) -> Result<T, A> {
    let mut slot = Some(value);
    if let Some(target) = (&mut slot as &mut dyn Any).downcast_mut::<Option<T>>() {
        return Ok(target.take().expect("the slot was filled above"));
    }
    Err(slot.expect("the slot is untouched when the types differ"))
}

/// `value` as a `T`, where the caller has already established that `A` is `T`.
pub(crate) fn same<A: 'static, T: 'static>(value: A) -> T {
    cast(value).unwrap_or_else(|_| unreachable!("the types were checked to be equal"))
}
