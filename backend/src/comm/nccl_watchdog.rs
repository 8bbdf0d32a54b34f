//! The deadline of NCCL collectives that nobody waits for on the host.
//!
//! A collective enqueued on CubeCL's stream returns at once (`comm::nccl_tensor` with
//! `WILDFIRE_NCCL_STREAM=1`), so no caller is there to notice a peer that never comes. The
//! watchdog is: one thread per communicator that holds a CUDA event recorded after each such
//! collective and polls the oldest, and NCCL's asynchronous error, every 50 µs while any is
//! pending. When an event is still incomplete at its deadline (the group's timeout after the
//! enqueue), or NCCL reports an error, it logs the call, the group and the rank, aborts the
//! communicator (which stops its kernels) and ends the process, as PyTorch's NCCL process group
//! does by default: the collective's result was already handed to the step, so the only safe
//! outcome is a failed rank, which `wildfire launch` turns into a failed job.
//!
//! **Not yet run on a GPU**, and a stuck peer needs two GPUs to stage: no machine of ours has
//! them. It compiles with `--features cuda`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{CUevent, CUevent_flags, CUresult};

use super::error::CommError;
use super::nccl::{NcclLibrary, RawComm, RawStream};

/// A collective in flight: the event recorded after it, and when it must have completed.
struct Pending {
    event: CUevent,
    deadline: Instant,
    call: String,
}

// SAFETY: a CUDA event may be queried and destroyed from any thread of its context.
unsafe impl Send for Pending {}

/// The communicator as the watchdog thread sees it.
struct Watched {
    library: &'static NcclLibrary,
    comm: RawComm,
    context: Arc<CudaContext>,
    /// The group and rank, for the log.
    who: String,
}

// SAFETY: the watchdog only asks NCCL for the communicator's asynchronous error and aborts it,
// both of which NCCL allows from another thread than the one issuing collectives.
unsafe impl Send for Watched {}

/// The watchdog of one communicator; dropping it waits for what is still pending.
#[derive(Debug)]
pub struct Watchdog {
    sender: Option<Sender<Pending>>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// A watchdog of `comm` (of `library`, in `context`), named `who` (group and rank) in its log.
    pub fn start(
        library: &'static NcclLibrary,
        comm: RawComm,
        context: Arc<CudaContext>,
        who: String,
    ) -> Self {
        let (sender, receiver) = channel();
        let watched = Watched {
            library,
            comm,
            context,
            who,
        };
        let thread = std::thread::Builder::new()
            .name("wildfire-nccl-watchdog".into())
            .spawn(move || watch(watched, receiver))
            .expect("starting the NCCL watchdog thread");
        Self {
            sender: Some(sender),
            thread: Some(thread),
        }
    }

    /// Records an event on `stream` after the collective `call` just enqueued there, to be
    /// complete within `timeout`.
    pub fn watch(&self, call: &str, stream: RawStream, timeout: Duration) -> Result<(), CommError> {
        let cuda = |what: &str, e: cudarc::driver::DriverError| {
            CommError::Cuda(format!("{what} after {call}: {e:?}"))
        };
        let event = cudarc::driver::result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda("creating an event", e))?;
        // SAFETY: the event was just created; the stream is live (the collective is on it).
        unsafe { cudarc::driver::result::event::record(event, stream as _) }
            .map_err(|e| cuda("recording an event", e))?;
        let pending = Pending {
            event,
            deadline: Instant::now() + timeout,
            call: call.to_string(),
        };
        let sender = self.sender.as_ref().expect("a running watchdog");
        sender.send(pending).map_err(|_| {
            CommError::Nccl(format!("the NCCL watchdog stopped; {call} is not watched"))
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Closing the channel lets the thread finish what is pending and end.
        drop(self.sender.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The watchdog thread: see the module doc.
fn watch(watched: Watched, receiver: Receiver<Pending>) {
    let _ = watched.context.bind_to_thread();
    let mut pending = VecDeque::new();
    let mut open = true;
    while open || !pending.is_empty() {
        let wait = match pending.is_empty() {
            true => Duration::from_secs(1),
            false => Duration::from_micros(50),
        };
        match receiver.recv_timeout(wait) {
            Ok(next) => pending.push_back(next),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => open = false,
        }
        while let Some(front) = pending.front() {
            // SAFETY: the event is live until destroyed below, once.
            match unsafe { cudarc::driver::result::event::query(front.event) } {
                Ok(()) => {
                    let done = pending.pop_front().expect("the front");
                    // SAFETY: complete, and destroyed once.
                    let _ = unsafe { cudarc::driver::result::event::destroy(done.event) };
                }
                Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_READY => {
                    if Instant::now() >= front.deadline {
                        let reason = format!("{} did not complete by its deadline", front.call);
                        fail(&watched, &reason);
                    }
                    break;
                }
                Err(e) => fail(
                    &watched,
                    &format!("{} failed on the device: {e:?}", front.call),
                ),
            }
        }
        if !pending.is_empty() {
            let mut async_error = 0;
            // SAFETY: the communicator is live while collectives are pending on it.
            let status =
                unsafe { (watched.library.comm_get_async_error)(watched.comm, &mut async_error) };
            let library = watched.library;
            let checked = library
                .check("ncclCommGetAsyncError", status)
                .and_then(|()| library.check("a pending collective", async_error));
            if let Err(error) = checked {
                fail(&watched, &error.to_string());
            }
        }
    }
}

/// Logs `reason`, aborts the communicator and ends the process.
fn fail(watched: &Watched, reason: &str) -> ! {
    log::error!(
        "NCCL watchdog, {}: {reason}; aborting the communicator and ending the process",
        watched.who
    );
    eprintln!(
        "wildfire: NCCL watchdog, {}: {reason}; aborting the communicator and ending the process",
        watched.who
    );
    // SAFETY: abort is NCCL's way to stop a communicator from another thread; nothing uses it
    // afterwards, the process ends.
    unsafe { (watched.library.comm_abort)(watched.comm) };
    std::process::abort()
}
