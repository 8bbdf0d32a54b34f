//! Host buffers that several ranks of one process read at once without copies.
//!
//! A collective turns its input into a [`SharedBuf`] and sends [`Payload`] views of regions of it
//! to peers. On the local transport a peer reads the region straight from the owner's memory; on
//! the TCP transport a writer thread streams it to the socket. The owner keeps writing into
//! *other* regions meanwhile (the in-place reduce and gather of all-reduce), so the buffer hands
//! out raw region access under one rule, which every algorithm in `algorithms.rs` follows:
//!
//! **A region is written only while no view of it is being read.** Peers read a view only
//! between receiving it and sending their answer for that region, and the owner writes a region
//! it has sent only after it received that answer.
//!
//! When the collective ends, the owner waits until every view is dropped and takes its `Vec` back.

use std::any::Any;
use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::element::{CommElem, WireDType};

/// A `Vec<E>` whose disjoint regions may be read and written from several threads.
pub(crate) struct SharedBuf<E> {
    data: UnsafeCell<Vec<E>>,
    ptr: *mut E,
    len: usize,
}

// SAFETY: access goes through the region methods, whose callers uphold the rule in the module
// docs; E itself is Send + Sync.
unsafe impl<E: Send + Sync> Send for SharedBuf<E> {}
unsafe impl<E: Send + Sync> Sync for SharedBuf<E> {}

impl<E: CommElem> SharedBuf<E> {
    pub(crate) fn new(mut data: Vec<E>) -> Arc<Self> {
        let ptr = data.as_mut_ptr();
        let len = data.len();
        Arc::new(Self {
            data: UnsafeCell::new(data),
            ptr,
            len,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Reads a region.
    ///
    /// # Safety
    /// Nobody writes `range` while the returned slice lives.
    pub(crate) unsafe fn region(&self, range: Range<usize>) -> &[E] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "region out of bounds"
        );
        // SAFETY: in bounds (checked above); no concurrent writer (caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }

    /// Writes a region.
    ///
    /// # Safety
    /// Nobody else reads or writes `range` while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn region_mut(&self, range: Range<usize>) -> &mut [E] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "region out of bounds"
        );
        // SAFETY: in bounds (checked above); exclusive access to the range (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// The address of element `start`, for the shared-memory all-reduce.
    pub(crate) fn ptr_at(&self, start: usize) -> *mut E {
        assert!(start <= self.len, "pointer out of bounds");
        // SAFETY: within the allocation (checked above).
        unsafe { self.ptr.add(start) }
    }

    /// Takes the `Vec` back once every other handle (every view sent to a peer) is dropped.
    ///
    /// Peers drop their views right after the last read, so this rarely waits. Gives the buffer
    /// back as `Err` if views are still alive at `deadline`.
    pub(crate) fn into_vec(mut this: Arc<Self>, deadline: Instant) -> Result<Vec<E>, Arc<Self>> {
        let mut spins = 0u32;
        loop {
            match Arc::try_unwrap(this) {
                Ok(buf) => return Ok(buf.data.into_inner()),
                Err(shared) => this = shared,
            }
            if Instant::now() >= deadline {
                return Err(this);
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

/// A type-erased [`SharedBuf`], so messages of any element type share one mailbox.
pub(crate) trait ErasedBuf: Send + Sync {
    fn dtype(&self) -> WireDType;
    fn elems(&self) -> usize;
    fn as_any(&self) -> &dyn Any;
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
    /// The bytes of an element range.
    ///
    /// # Safety
    /// As [`SharedBuf::region`].
    unsafe fn bytes(&self, range: Range<usize>) -> &[u8];
}

impl<E: CommElem> ErasedBuf for SharedBuf<E> {
    fn dtype(&self) -> WireDType {
        E::DTYPE
    }
    fn elems(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
    unsafe fn bytes(&self, range: Range<usize>) -> &[u8] {
        // SAFETY: forwarded contract.
        bytemuck::cast_slice(unsafe { self.region(range) })
    }
}

/// The data of one message: a region of a shared buffer, or a whole buffer the message owns.
#[derive(Clone)]
pub(crate) struct Payload {
    buf: Arc<dyn ErasedBuf>,
    range: Range<usize>,
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Payload({:?}, {:?})", self.buf.dtype(), self.range)
    }
}

impl Payload {
    /// A message with no data.
    pub(crate) fn empty() -> Self {
        Self::owned(Vec::<u8>::new())
    }

    /// A payload owning `data` (no other handle sees it).
    pub(crate) fn owned<E: CommElem>(data: Vec<E>) -> Self {
        let len = data.len();
        Self {
            buf: SharedBuf::new(data),
            range: 0..len,
        }
    }

    /// A view of `range` of a shared buffer. The sender promises not to write that range until
    /// the receiver has answered for it (module docs).
    pub(crate) fn view<E: CommElem>(buf: &Arc<SharedBuf<E>>, range: Range<usize>) -> Self {
        assert!(range.end <= buf.len(), "view out of bounds");
        Self {
            buf: buf.clone(),
            range,
        }
    }

    pub(crate) fn dtype(&self) -> WireDType {
        self.buf.dtype()
    }

    pub(crate) fn elems(&self) -> usize {
        self.range.len()
    }

    /// The payload's bytes, for writing to a socket.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the sender does not write a region it sent until the receiver answered, and
        // the receiver answers only after it has read these bytes.
        unsafe { self.buf.bytes(self.range.clone()) }
    }

    /// The elements, if the payload holds `E`.
    pub(crate) fn slice<E: CommElem>(&self) -> Option<&[E]> {
        let buf = self.buf.as_any().downcast_ref::<SharedBuf<E>>()?;
        // SAFETY: as for `bytes`.
        Some(unsafe { buf.region(self.range.clone()) })
    }

    /// The region's address and length, if the payload holds `E`: for the shared-memory
    /// all-reduce, whose senders grant the receiver write access to the region they send.
    pub(crate) fn region_ptr<E: CommElem>(&self) -> Option<(*mut E, usize)> {
        let buf = self.buf.as_any().downcast_ref::<SharedBuf<E>>()?;
        Some((buf.ptr_at(self.range.start), self.range.len()))
    }

    /// The elements as an owned `Vec`: without a copy when this payload is the buffer's only
    /// handle and covers all of it (a received point-to-point message), with one otherwise.
    pub(crate) fn into_vec<E: CommElem>(self) -> Option<Vec<E>> {
        let whole = self.range.start == 0 && self.range.end == self.buf.elems();
        if whole && Arc::strong_count(&self.buf) == 1 {
            let range = self.range.clone();
            let shared = self.buf.into_any().downcast::<SharedBuf<E>>().ok()?;
            return match Arc::try_unwrap(shared) {
                Ok(buf) => Some(buf.data.into_inner()),
                // SAFETY: as for `bytes`.
                Err(shared) => Some(unsafe { shared.region(range) }.to_vec()),
            };
        }
        self.slice::<E>().map(<[E]>::to_vec)
    }
}
