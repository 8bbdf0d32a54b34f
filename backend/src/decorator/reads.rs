//! Blocking reads, counted: each time a thread reads a tensor's values to the host through
//! `Parallel<B>` (`into_data` of a float, int or bool tensor, which `into_scalar` and
//! `to_data` call too), that thread's count grows by one.
//!
//! A GPU runs ahead of the host only while the host does not wait for it, and a read waits for
//! every queued kernel that the value depends on. So this count is what says whether a training
//! step lets the device run ahead: a steady step should read nothing (the loss and the gradient
//! norm stay on the device until the loop logs them).
//!
//! A collective that moves a tensor through host memory (the tcp, shm and in-process transports)
//! reads it too, but that read *is* the communication, which a device transport (NCCL) does
//! without the host: such reads are not counted ([`CollectiveRead`] marks them). The count is
//! per thread, so thread ranks each see their own.
//!
//! A read can also hand its bytes back misaligned, as burn-cuda's reads from CubeCL's staging
//! pool may (`crate::host_data`): with `WILDFIRE_MISALIGNED_READS=1`, every read through
//! the decorator returns its bytes one past an allocation's start, so a run on the CPU shows
//! whether every reader of device data copes, as it must on a GPU. A test tool; off by default.

use std::cell::Cell;
use std::sync::OnceLock;

use burn::tensor::TensorData;

use crate::host_data::misaligned;

thread_local! {
    static READS: Cell<u64> = const { Cell::new(0) };
    static IN_COLLECTIVE: Cell<usize> = const { Cell::new(0) };
}

/// The blocking reads this thread has made so far (see the module doc); the difference of two
/// calls counts the reads between them.
pub fn blocking_reads() -> u64 {
    READS.with(Cell::get)
}

/// Counts one read on this thread, unless a collective is reading.
pub(crate) fn count_read() {
    if IN_COLLECTIVE.with(Cell::get) == 0 {
        READS.with(|reads| reads.set(reads.get() + 1));
    }
}

/// Whether this process's reads hand their bytes back misaligned (see the module doc).
fn misaligned_reads() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    #[cfg(test)]
    if MISALIGNED_ON_THIS_THREAD.with(Cell::get) {
        return true;
    }
    *ON.get_or_init(|| std::env::var("WILDFIRE_MISALIGNED_READS").is_ok_and(|v| v == "1"))
}

#[cfg(test)]
thread_local! {
    /// The switch for one test thread, where the environment would reach every test.
    static MISALIGNED_ON_THIS_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// What a read returns for the `data` it got: `data`, or its bytes misaligned where this
/// process asks for that (see the module doc). Decided when the read starts.
pub(crate) fn as_read() -> impl Fn(TensorData) -> TensorData + Send {
    let misalign = misaligned_reads();
    move |data| if misalign { misaligned(data) } else { data }
}

/// While alive, this thread's reads are a collective's transfers and are not counted.
pub(crate) struct CollectiveRead(());

impl CollectiveRead {
    pub(crate) fn start() -> Self {
        IN_COLLECTIVE.with(|depth| depth.set(depth.get() + 1));
        Self(())
    }
}

impl Drop for CollectiveRead {
    fn drop(&mut self) {
        IN_COLLECTIVE.with(|depth| depth.set(depth.get() - 1));
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Int, Tensor};

    use super::*;
    use crate::Parallel;

    type B = Parallel<Flex>;

    #[test]
    fn reads_through_the_decorator_are_counted_except_a_collectives() {
        let device = Default::default();
        let before = blocking_reads();
        let x = Tensor::<B, 1>::from_floats([1.0, 2.0], &device);
        let y = (x.clone() * 2.0).sum();
        assert_eq!(
            blocking_reads(),
            before,
            "building and computing reads nothing"
        );
        let _ = y.into_scalar();
        let _ = x.clone().greater_elem(1.0).into_data();
        let _ = Tensor::<B, 1, Int>::arange(0..3, &device).into_data();
        assert_eq!(blocking_reads(), before + 3);
        {
            let _collective = CollectiveRead::start();
            let _ = x.clone().into_data();
        }
        assert_eq!(
            blocking_reads(),
            before + 3,
            "a collective's read is not counted"
        );
        let _ = x.into_data();
        assert_eq!(blocking_reads(), before + 4, "counting resumes after it");
        let elsewhere = std::thread::spawn(blocking_reads).join().unwrap();
        assert_eq!(elsewhere, 0, "another thread has its own count");
    }

    #[test]
    fn reads_hand_back_misaligned_bytes_where_asked_and_the_readers_cope() {
        let device = Default::default();
        let values = [1.5f32, -2.0, 3.25];
        let x = Tensor::<B, 1>::from_floats(values, &device);
        let read = x.clone().into_data();
        assert_eq!(
            read.as_bytes().as_ptr().align_offset(4),
            0,
            "aligned unasked"
        );
        MISALIGNED_ON_THIS_THREAD.with(|on| on.set(true));
        let read = x.clone().into_data();
        let ints = Tensor::<B, 1, Int>::arange(0..3, &device).into_data();
        MISALIGNED_ON_THIS_THREAD.with(|on| on.set(false));
        for data in [&read, &ints] {
            assert_ne!(data.as_bytes().as_ptr().align_offset(4), 0, "{data:?}");
        }
        assert!(
            read.as_slice::<f32>().is_err(),
            "Burn's in-place view fails"
        );
        assert_eq!(crate::host_data::host_values::<f32>(read).unwrap(), values);
        assert_eq!(
            crate::host_data::host_values::<i32>(ints).unwrap(),
            [0, 1, 2]
        );
    }
}
