//! Tensor values on the host, whatever the alignment of the bytes a backend hands back.
//!
//! `TensorData::to_vec`, `as_slice` and `iter`, and backends that adopt a `TensorData`'s bytes
//! (Flex), reinterpret the bytes in place, which needs them aligned for the element type.
//! burn-cuda's reads land in CubeCL's pinned staging pool, whose slices are not always aligned
//! that way: on an H200, reading tensors back made `iter` panic
//! (`TargetAlignmentGreaterAndInputNotAligned`). [`aligned`] copies such bytes into a fresh
//! allocation of the element's alignment; aligned bytes are kept as they are, without a copy.
//! [`misaligned`] makes such bytes on purpose, so a CPU run can check that every reader copes
//! (`WILDFIRE_MISALIGNED_READS`: the decorator's reads).

use std::mem::MaybeUninit;

use burn::tensor::{Bytes, DataError, Element, TensorData};
use bytemuck::Pod;
use cubecl::bytes::{AllocationController, AllocationProperty};

/// `data` with its bytes aligned for its element type (copied only where they are not).
pub fn aligned(data: TensorData) -> TensorData {
    let size = data.dtype.size();
    if data.as_bytes().as_ptr().align_offset(size) == 0 {
        return data;
    }
    let bytes = match size {
        8 => Bytes::from_elems(bytemuck::pod_collect_to_vec::<u8, u64>(data.as_bytes())),
        4 => Bytes::from_elems(bytemuck::pod_collect_to_vec::<u8, u32>(data.as_bytes())),
        2 => Bytes::from_elems(bytemuck::pod_collect_to_vec::<u8, u16>(data.as_bytes())),
        _ => Bytes::from_bytes_vec(data.as_bytes().to_vec()),
    };
    TensorData::from_bytes(bytes, data.shape.clone(), data.dtype)
}

/// The values of `data` as `Vec<E>`; `E` must be the data's element type.
pub fn host_values<E: Element + Pod>(data: TensorData) -> Result<Vec<E>, DataError> {
    aligned(data).into_vec::<E>()
}

/// `data` with its bytes copied to one byte past the start of an allocation, so they are
/// misaligned for every element wider than a byte: what a staging pool may hand back.
pub fn misaligned(data: TensorData) -> TensorData {
    let mut buffer = vec![MaybeUninit::new(0u8)];
    buffer.extend(data.as_bytes().iter().map(|&b| MaybeUninit::new(b)));
    let len = buffer.len() - 1;
    // SAFETY: every byte of the controller's memory is initialised.
    let bytes = unsafe { Bytes::from_controller(Box::new(OffsetByOne(buffer)), len) };
    TensorData::from_bytes(bytes, data.shape.clone(), data.dtype)
}

/// Bytes one past the start of a buffer, as a pool hands out a slice of a larger allocation.
struct OffsetByOne(Vec<MaybeUninit<u8>>);

impl AllocationController for OffsetByOne {
    fn alloc_align(&self) -> usize {
        1
    }
    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }
    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        &mut self.0[1..]
    }
    fn memory(&self) -> &[MaybeUninit<u8>] {
        &self.0[1..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn misaligned_f32(values: &[f32]) -> TensorData {
        misaligned(TensorData::new(values.to_vec(), [values.len()]))
    }

    #[test]
    fn misaligned_bytes_are_copied_and_aligned_ones_taken_over() {
        let values = [1.5f32, -2.25, 3.0, f32::MIN_POSITIVE];
        let misaligned = misaligned_f32(&values);
        assert_ne!(misaligned.as_bytes().as_ptr().align_offset(4), 0);
        assert!(
            misaligned.as_slice::<f32>().is_err(),
            "Burn's in-place view fails"
        );
        let copied = aligned(misaligned_f32(&values));
        assert_eq!(copied.as_bytes(), misaligned.as_bytes());
        let widened: Vec<f64> = copied.iter::<f64>().collect();
        assert_eq!(widened, values.map(f64::from));
        assert_eq!(host_values::<f32>(misaligned).unwrap(), values);
        let aligned = TensorData::new(values.to_vec(), [4]);
        assert_eq!(host_values::<f32>(aligned).unwrap(), values);
    }

    #[test]
    fn the_wrong_element_type_is_burns_error() {
        let data = TensorData::new(vec![1i32, 2], [2]);
        let err = host_values::<f32>(data).unwrap_err();
        assert!(format!("{err:?}").contains("TypeMismatch"), "{err:?}");
    }
}
