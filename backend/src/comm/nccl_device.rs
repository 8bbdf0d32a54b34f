//! An NCCL communicator on one CUDA device: creation through the rendezvous store, and the
//! collectives on raw device pointers, each waited for within the group's deadline.
//!
//! **Not yet run on a GPU** (no device was available when it was written); it compiles with
//! `--features cuda` and is exercised by `scripts/gpu-check.sh` once the tensor path uses it.
//!
//! **Ordering.** Each collective is enqueued on the communicator's own CUDA stream, in the
//! device's primary context (the one CubeCL uses). The caller must have finished (synchronised)
//! the work that produces the input buffers before calling, because CubeCL does not expose its
//! streams for event-based ordering; the call returns after the collective completed on the
//! device, so the output can be used by any stream afterwards. Waiting polls an event, so a
//! stuck peer becomes a timeout (the communicator is then aborted) instead of a hang.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};

use super::error::CommError;
use super::nccl::{NcclLibrary, RawComm, RawStream, share_unique_id};
use super::store::StoreClient;

/// Why CUDA is not usable, checked without touching anything that would panic.
pub fn check_cuda_driver() -> Result<(), CommError> {
    // SAFETY: only tries to open the driver library; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::Cuda(
            "no NVIDIA driver: libcuda.so.1 could not be loaded (is this a GPU machine?)".into(),
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| CommError::Cuda(format!("the driver failed to initialise: {e:?}")))
}

/// One rank's NCCL communicator for a group, on one device.
#[derive(Debug)]
pub struct NcclComm {
    library: &'static NcclLibrary,
    comm: RawComm,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    group: String,
    rank: usize,
    timeout: Duration,
}

// SAFETY: the communicator is used by one thread at a time (collectives take `&mut self`), and
// NCCL communicators may be moved between threads.
unsafe impl Send for NcclComm {}

fn driver_error(what: &str, error: cudarc::driver::DriverError) -> CommError {
    CommError::Cuda(format!("{what}: {error:?}"))
}

impl NcclComm {
    /// Joins `group`'s communicator as `rank` of `size` on device `ordinal`. Rank 0 creates
    /// the unique id; the ranks meet at a store barrier (within the store's deadline), then
    /// enter `ncclCommInitRank`, which returns when all have.
    pub fn init(
        store: &StoreClient,
        group: &str,
        (rank, size): (usize, usize),
        ordinal: usize,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        check_cuda_driver()?;
        let library = NcclLibrary::get()?;
        let context = CudaContext::new(ordinal)
            .map_err(|e| driver_error(&format!("opening CUDA device {ordinal}"), e))?;
        context
            .bind_to_thread()
            .map_err(|e| driver_error("binding the CUDA context", e))?;
        let stream = context
            .new_stream()
            .map_err(|e| driver_error("creating the NCCL stream", e))?;
        let id = share_unique_id(store, group, rank, timeout, || library.unique_id())?;
        // ncclCommInitRank blocks until every rank has called it, with no deadline of its own:
        // meet in the store first, so a rank that never comes is a timeout naming the count.
        store.barrier(&format!("wildfire/nccl/{group}/init"), size)?;
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: comm receives the new communicator; id is the group's shared unique id.
        let status =
            unsafe { (library.comm_init_rank)(&mut comm, size as c_int, id, rank as c_int) };
        library.check("ncclCommInitRank", status)?;
        Ok(Self {
            library,
            comm,
            context,
            stream,
            group: group.to_string(),
            rank,
            timeout,
        })
    }

    fn raw_stream(&self) -> RawStream {
        self.stream.cu_stream() as RawStream
    }

    /// Enqueues one NCCL call (which returns its status) on a live communicator and waits for
    /// it on the device.
    fn run(
        &mut self,
        call: &str,
        enqueue: impl FnOnce(RawComm, RawStream) -> c_int,
    ) -> Result<(), CommError> {
        self.live()?;
        self.context
            .bind_to_thread()
            .map_err(|e| driver_error("binding the CUDA context", e))?;
        let status = enqueue(self.comm, self.raw_stream());
        self.library.check(call, status)?;
        self.wait(call)
    }

    /// Polls the stream's completion and NCCL's asynchronous error until the deadline; on
    /// timeout the communicator is aborted, so no later call can hang on it.
    fn wait(&mut self, call: &str) -> Result<(), CommError> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| driver_error("recording a completion event", e))?;
        let deadline = Instant::now() + self.timeout;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(driver_error(&format!("{call} on the device"), e)),
            }
            let mut async_error = 0;
            // SAFETY: comm is live; the status is written through the pointer.
            let status =
                unsafe { (self.library.comm_get_async_error)(self.comm, &mut async_error) };
            self.library.check("ncclCommGetAsyncError", status)?;
            self.library.check(call, async_error)?;
            if Instant::now() >= deadline {
                // SAFETY: abort ends the communicator; it is not used again (comm is nulled).
                unsafe { (self.library.comm_abort)(self.comm) };
                self.comm = std::ptr::null_mut();
                return Err(CommError::Nccl(format!(
                    "{call} in {} timed out after {:.1} s on rank {} (communicator aborted)",
                    self.group,
                    self.timeout.as_secs_f64(),
                    self.rank
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn live(&self) -> Result<(), CommError> {
        if self.comm.is_null() {
            return Err(CommError::Nccl(format!(
                "the NCCL communicator of {} was aborted after an earlier timeout",
                self.group
            )));
        }
        Ok(())
    }

    /// `recv = reduce(send)` over the group; `count` elements of NCCL type `dtype`.
    ///
    /// # Safety
    /// `send` and `recv` must be device pointers of this device holding `count` elements,
    /// whose producing work has completed.
    pub unsafe fn all_reduce(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
        op: c_int,
    ) -> Result<(), CommError> {
        let f = self.library.all_reduce;
        // SAFETY: the caller guarantees the buffers; comm and stream are live.
        self.run("ncclAllReduce", |comm, stream| unsafe {
            f(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype,
                op,
                comm,
                stream,
            )
        })
    }

    /// `recv` (size × `count`) = the concatenation of every rank's `send` (`count`), in rank order.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce), with `recv` holding `size · count` elements.
    pub unsafe fn all_gather(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
    ) -> Result<(), CommError> {
        let f = self.library.all_gather;
        // SAFETY: as above.
        self.run("ncclAllGather", |comm, stream| unsafe {
            f(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype,
                comm,
                stream,
            )
        })
    }

    /// `recv` (`count`) = this rank's block of `reduce(send)` (size × `count`).
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce), with `send` holding `size · count` elements.
    pub unsafe fn reduce_scatter(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
        op: c_int,
    ) -> Result<(), CommError> {
        let f = self.library.reduce_scatter;
        // SAFETY: as above.
        self.run("ncclReduceScatter", |comm, stream| unsafe {
            f(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype,
                op,
                comm,
                stream,
            )
        })
    }

    /// `recv` = `root`'s `send` on every rank.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce).
    pub unsafe fn broadcast(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
        root: usize,
    ) -> Result<(), CommError> {
        let f = self.library.broadcast;
        // SAFETY: as above.
        self.run("ncclBroadcast", |comm, stream| unsafe {
            f(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype,
                root as c_int,
                comm,
                stream,
            )
        })
    }

    /// Sends `count` elements to `peer` (group rank), which must post the matching receive.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce), for `buffer`.
    pub unsafe fn send(
        &mut self,
        buffer: u64,
        count: usize,
        dtype: c_int,
        peer: usize,
    ) -> Result<(), CommError> {
        let f = self.library.send;
        // SAFETY: as above.
        self.run("ncclSend", |comm, stream| unsafe {
            f(
                buffer as *const c_void,
                count,
                dtype,
                peer as c_int,
                comm,
                stream,
            )
        })
    }

    /// Receives `count` elements from `peer` (group rank) into `buffer`.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce), for `buffer`.
    pub unsafe fn recv(
        &mut self,
        buffer: u64,
        count: usize,
        dtype: c_int,
        peer: usize,
    ) -> Result<(), CommError> {
        let f = self.library.recv;
        // SAFETY: as above.
        self.run("ncclRecv", |comm, stream| unsafe {
            f(
                buffer as *mut c_void,
                count,
                dtype,
                peer as c_int,
                comm,
                stream,
            )
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            let _ = self.context.bind_to_thread();
            // SAFETY: the communicator is live and dropped once.
            unsafe { (self.library.comm_destroy)(self.comm) };
        }
    }
}
