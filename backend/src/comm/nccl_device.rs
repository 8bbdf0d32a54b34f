//! An NCCL communicator on one CUDA device: joined from plain arguments (a unique id and the
//! member's rank, size and device; `comm::nccl_tensor` agrees on the id within a process
//! group), the collectives on raw device pointers, each waited for within the group's deadline,
//! and a one-rank probe. `comm::nccl_tensor` calls it with the device buffers of CUDA tensors.
//!
//! **Not yet run on a GPU**: no device was available to the sessions that wrote it. It compiles
//! with `--features cuda`; `scripts/gpu-check.sh` runs it (the probe, the tensor collectives at
//! every GPU count present).
//!
//! **Ordering.** Each collective is enqueued on the communicator's own CUDA stream, in the
//! device's primary context (the one CubeCL uses). The caller must have finished (synchronised)
//! the work that produces the input buffers before calling; the call returns after the
//! collective completed on the device, so the output can be used by any stream afterwards.
//! Waiting polls an event, so a stuck peer becomes a timeout (the communicator is then aborted)
//! instead of a hang.
//!
//! **On another stream** ([`NcclComm::on_stream`]): the collectives called inside are enqueued
//! on the caller's stream (CubeCL's, ordered after the kernels that wrote the inputs) and return
//! at once; their deadline is kept by the communicator's watchdog thread
//! ([`super::nccl_watchdog`]).

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};

use super::element::{ReduceOp, WireDType};
use super::error::CommError;
use super::nccl::{NcclLibrary, RawComm, RawStream, UniqueId, nccl_dtype, nccl_op};
use super::nccl_watchdog::Watchdog;

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

/// Who joins a communicator: rank `rank` of `size`, on CUDA device `ordinal`, waiting at
/// most `timeout` for any call; `group` names the group in errors.
#[derive(Debug, Clone)]
pub struct NcclMember {
    pub group: String,
    pub rank: usize,
    pub size: usize,
    pub ordinal: usize,
    pub timeout: Duration,
}

/// One rank's NCCL communicator for a group, on one device.
#[derive(Debug)]
pub struct NcclComm {
    library: &'static NcclLibrary,
    comm: RawComm,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    group: String,
    ordinal: usize,
    /// The stream collectives go to inside [`Self::on_stream`], instead of `stream`.
    on_stream: Option<RawStream>,
    /// Keeps the deadline of collectives nobody waits for; started at the first.
    watchdog: Option<Watchdog>,
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
    /// A new unique id for a communicator, made by the rank that shares it with the others.
    pub fn unique_id() -> Result<UniqueId, CommError> {
        NcclLibrary::get()?.unique_id()
    }

    /// Joins the communicator of `id` as `member`, on CUDA device `member.ordinal`.
    ///
    /// Every member must call this with the same id (made by one of them, [`Self::unique_id`])
    /// once all of them can: `ncclCommInitRank` has no deadline of its own and returns only
    /// when every rank called it, so callers meet first (a store or group barrier).
    pub fn join(member: NcclMember, id: UniqueId) -> Result<Self, CommError> {
        check_cuda_driver()?;
        let library = NcclLibrary::get()?;
        let ordinal = member.ordinal;
        let context = CudaContext::new(ordinal)
            .map_err(|e| driver_error(&format!("opening CUDA device {ordinal}"), e))?;
        context
            .bind_to_thread()
            .map_err(|e| driver_error("binding the CUDA context", e))?;
        let stream = context
            .new_stream()
            .map_err(|e| driver_error("creating the NCCL stream", e))?;
        let mut comm: RawComm = std::ptr::null_mut();
        let (rank, size) = (member.rank as c_int, member.size as c_int);
        // SAFETY: comm receives the new communicator; id is the group's shared unique id.
        let status = unsafe { (library.comm_init_rank)(&mut comm, size, id, rank) };
        library.check("ncclCommInitRank", status)?;
        Ok(Self {
            library,
            comm,
            context,
            stream,
            group: member.group,
            ordinal,
            on_stream: None,
            watchdog: None,
            rank: member.rank,
            timeout: member.timeout,
        })
    }

    /// The CUDA device this communicator runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn raw_stream(&self) -> RawStream {
        self.on_stream
            .unwrap_or(self.stream.cu_stream() as RawStream)
    }

    /// Runs `f` with every collective it calls enqueued on `stream` (a stream of this device's
    /// primary context) and returning once enqueued, not completed: work queued on `stream`
    /// later runs after them. Their deadline is the watchdog's ([`super::nccl_watchdog`]).
    pub fn on_stream<T>(&mut self, stream: RawStream, f: impl FnOnce(&mut Self) -> T) -> T {
        self.on_stream = Some(stream);
        let result = f(self);
        self.on_stream = None;
        result
    }

    /// Hands the collective `call`, just enqueued on `stream`, to the watchdog.
    fn watch(&mut self, call: &str, stream: RawStream) -> Result<(), CommError> {
        let (library, comm, context) = (self.library, self.comm, self.context.clone());
        let who = format!("{} rank {}", self.group, self.rank);
        let watchdog = self
            .watchdog
            .get_or_insert_with(|| Watchdog::start(library, comm, context, who));
        watchdog.watch(call, stream, self.timeout)
    }

    /// Enqueues one NCCL call (which returns its status) on a live communicator and waits for
    /// it on the device. Any failure aborts the communicator (see [`abort`](Self::abort)).
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
        let result = self
            .library
            .check(call, status)
            .and_then(|()| match self.on_stream {
                Some(stream) => self.watch(call, stream),
                None => self.wait(call),
            });
        result.map_err(|error| self.abort(error))
    }

    /// Polls the stream's completion and NCCL's asynchronous error until the deadline.
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
                return Err(CommError::Nccl(format!(
                    "{call} in {} timed out after {:.1} s on rank {}",
                    self.group,
                    self.timeout.as_secs_f64(),
                    self.rank
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Ends the communicator after `error`: aborts it (which stops its kernels), waits for its
    /// stream, so the buffers the caller frees next are no longer in use, and marks it dead so
    /// later calls fail at once instead of hanging on it.
    fn abort(&mut self, error: CommError) -> CommError {
        // SAFETY: abort ends the communicator; it is not used again (comm is nulled).
        unsafe { (self.library.comm_abort)(self.comm) };
        self.comm = std::ptr::null_mut();
        let drained = self.stream.synchronize();
        let note = match drained {
            Ok(()) => "communicator aborted".to_string(),
            Err(e) => format!("communicator aborted; its stream reported {e:?}"),
        };
        match error {
            CommError::Nccl(text) => CommError::Nccl(format!("{text} ({note})")),
            CommError::Cuda(text) => CommError::Cuda(format!("{text} ({note})")),
            other => other,
        }
    }

    fn live(&self) -> Result<(), CommError> {
        if self.comm.is_null() {
            return Err(CommError::Nccl(format!(
                "the NCCL communicator of {} was aborted after an earlier failure",
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
}

/// How many CUDA devices the driver sees.
pub fn cuda_device_count() -> Result<usize, CommError> {
    check_cuda_driver()?;
    let count =
        CudaContext::device_count().map_err(|e| driver_error("counting CUDA devices", e))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Checks NCCL end to end on CUDA device `ordinal` with a one-rank communicator, which any
/// machine with one GPU can run (the tensor path skips NCCL for groups of one): loads the
/// library, creates the communicator, runs every collective this module has on device buffers,
/// and compares the results; communicator creation waits at most `timeout`. Returns a one-line
/// description of what ran.
pub fn probe_one_rank(ordinal: usize, timeout: Duration) -> Result<String, CommError> {
    let member = NcclMember {
        group: "the one-rank probe".to_string(),
        rank: 0,
        size: 1,
        ordinal,
        timeout,
    };
    let mut comm = NcclComm::join(member, NcclComm::unique_id()?)?;
    let stream = comm.stream.clone();
    let failed = |what: &'static str| move |e| driver_error(what, e);
    let input: Vec<f32> = vec![1.0, -2.0, 3.5, 4.0];
    let count = input.len();
    let send = stream
        .clone_htod(&input)
        .map_err(failed("copying the probe input"))?;
    let recv = stream
        .alloc_zeros::<f32>(count)
        .map_err(failed("allocating the probe output"))?;
    stream
        .synchronize()
        .map_err(failed("synchronising the probe stream"))?;
    let (dtype, op) = (nccl_dtype(WireDType::F32), nccl_op(ReduceOp::Sum));
    let types = (dtype, WireDType::F32.size());
    let calls: [(&str, ProbeCall); 6] = [
        // SAFETY (all six): `send` and `recv` hold `count` f32 on this device, written above.
        ("all-reduce", |c, s, r, n, t, op| unsafe {
            c.all_reduce(s, r, n, t.0, op)
        }),
        ("broadcast", |c, s, r, n, t, _| unsafe {
            c.broadcast(s, r, n, t.0, 0)
        }),
        ("all-gather", |c, s, r, n, t, _| unsafe {
            c.all_gather(s, r, n, t.0)
        }),
        ("reduce-scatter", |c, s, r, n, t, op| unsafe {
            c.reduce_scatter(s, r, n, t.0, op)
        }),
        ("all-gather (grouped)", |c, s, r, n, t, _| unsafe {
            c.all_gather_v(s, r, &[n], t)
        }),
        ("reduce-scatter (grouped)", |c, s, r, n, t, op| unsafe {
            c.reduce_scatter_v(s, r, &[n], t, op)
        }),
    ];
    let mut recv = recv;
    for (name, call) in calls {
        stream
            .memset_zeros(&mut recv)
            .map_err(failed("clearing the probe output"))?;
        {
            let (send_ptr, _send_guard) = send.device_ptr(&stream);
            let (recv_ptr, _recv_guard) = recv.device_ptr(&stream);
            call(&mut comm, send_ptr, recv_ptr, count, types, op)?;
        }
        let output = stream
            .clone_dtoh(&recv)
            .map_err(failed("reading the probe output"))?;
        if output != input {
            return Err(CommError::Nccl(format!(
                "probe {name} on one rank returned {output:?}, expected {input:?}"
            )));
        }
    }
    let library = NcclLibrary::get()?;
    Ok(format!(
        "NCCL {} ({}): a one-rank communicator on CUDA device {ordinal} ran all-reduce, \
         broadcast, all-gather and reduce-scatter (plain and grouped) on device buffers, exact",
        library.version()?,
        library.path
    ))
}

/// One probe collective: `(comm, send, recv, count, (dtype, element bytes), op)`.
type ProbeCall = fn(&mut NcclComm, u64, u64, usize, (c_int, usize), c_int) -> Result<(), CommError>;

/// Element offsets of consecutive blocks of `counts` elements.
fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |start, count| {
            let offset = *start;
            *start += count;
            Some(offset)
        })
        .collect()
}

impl NcclComm {
    /// Enqueues `calls` as one NCCL group (`ncclGroupStart` … `ncclGroupEnd`, which NCCL runs
    /// as a single fused operation) and waits for it like [`run`](Self::run).
    fn run_grouped(
        &mut self,
        call: &str,
        calls: impl FnOnce(RawComm, RawStream) -> c_int,
    ) -> Result<(), CommError> {
        let (start, end) = (self.library.group_start, self.library.group_end);
        self.run(call, |comm, stream| {
            // SAFETY: group calls take no arguments; every group started is ended below.
            let started = unsafe { start() };
            if started != 0 {
                return started;
            }
            let status = calls(comm, stream);
            // SAFETY: as above.
            let ended = unsafe { end() };
            if status != 0 { status } else { ended }
        })
    }

    /// Runs `per_root(root, count, byte_offset, comm, stream)` for every rank as one NCCL
    /// group, where rank q's block has `counts[q]` elements and starts `Σ_{p<q} counts[p]`
    /// elements of `elem_bytes` into its buffer. Stops at the first non-zero status.
    fn run_per_root(
        &mut self,
        call: &str,
        counts: &[usize],
        elem_bytes: usize,
        per_root: impl Fn(c_int, usize, u64, RawComm, RawStream) -> c_int,
    ) -> Result<(), CommError> {
        let starts = offsets(counts);
        self.run_grouped(call, |comm, stream| {
            for (root, (&count, &start)) in counts.iter().zip(&starts).enumerate() {
                let byte_offset = (start * elem_bytes) as u64;
                let status = per_root(root as c_int, count, byte_offset, comm, stream);
                if status != 0 {
                    return status;
                }
            }
            0
        })
    }

    /// An all-gather with per-rank sizes: rank q's `counts[q]` elements (at `send` on rank q)
    /// land at element offset `Σ_{p<q} counts[p]` of `recv` on every rank. One group of
    /// broadcasts, one rooted at each rank.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce), with `send` holding `counts[rank]` elements and
    /// `recv` `Σ counts` elements of `elem_bytes` bytes.
    pub unsafe fn all_gather_v(
        &mut self,
        send: u64,
        recv: u64,
        counts: &[usize],
        (dtype, elem_bytes): (c_int, usize),
    ) -> Result<(), CommError> {
        let f = self.library.broadcast;
        let call = "ncclBroadcast (all-gather, uneven)";
        self.run_per_root(
            call,
            counts,
            elem_bytes,
            |root, count, offset, comm, stream| {
                let at = recv + offset;
                // SAFETY: the caller guarantees the buffers; `at` stays inside `recv`.
                unsafe {
                    f(
                        send as *const c_void,
                        at as *mut c_void,
                        count,
                        dtype,
                        root,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// A reduce-scatter with per-rank sizes: `recv` (`counts[rank]` elements) = this rank's
    /// block of `reduce(send)`, where `send` holds `Σ counts` elements and block q starts at
    /// `Σ_{p<q} counts[p]`. One group of reductions, one rooted at each rank.
    ///
    /// # Safety
    /// As [`all_gather_v`](Self::all_gather_v), with the roles of `send` and `recv` swapped.
    pub unsafe fn reduce_scatter_v(
        &mut self,
        send: u64,
        recv: u64,
        counts: &[usize],
        (dtype, elem_bytes): (c_int, usize),
        op: c_int,
    ) -> Result<(), CommError> {
        let f = self.library.reduce;
        let call = "ncclReduce (reduce-scatter, uneven)";
        self.run_per_root(
            call,
            counts,
            elem_bytes,
            |root, count, offset, comm, stream| {
                let from = send + offset;
                // SAFETY: the caller guarantees the buffers; `from` stays inside `send`.
                unsafe {
                    f(
                        from as *const c_void,
                        recv as *mut c_void,
                        count,
                        dtype,
                        op,
                        root,
                        comm,
                        stream,
                    )
                }
            },
        )
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // The watchdog first: it waits for the collectives still pending on the communicator.
        drop(self.watchdog.take());
        if !self.comm.is_null() {
            let _ = self.context.bind_to_thread();
            // SAFETY: the communicator is live and dropped once.
            unsafe { (self.library.comm_destroy)(self.comm) };
        }
    }
}
