//! Library work on the CUDA stream CubeCL launches on, in CubeCL's queue order.

use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::server::Handle;
use cubecl::stream_id::StreamId;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

/// The server of CubeCL's CUDA runtime: the state its device thread owns.
type CudaServer = <CudaRuntime as Runtime>::Server;

/// Runs `work(stream, pointers)` on CubeCL's device thread for `device`, after every operation
/// the calling thread queued on that device before, with CubeCL's stream for the calling
/// thread and the device pointers of `handles` (in their order, offsets included). Before
/// `work` runs, the stream waits (by CUDA event, not on the host) for the last writers of
/// those buffers on CubeCL's other streams.
///
/// `work` must only enqueue asynchronous work on `stream` (it runs on the device thread, which
/// every CubeCL operation of the device waits for): nothing here waits for the GPU. The caller
/// blocks until `work` has returned, so its error comes back as the result. The buffers stay
/// alive for the enqueued work as CubeCL's own kernels' do: memory a handle frees is reused
/// only by later work on the same stream, which runs after it.
pub fn enqueue<T, E>(
    device: &CudaDevice,
    handles: &[Handle],
    work: impl FnOnce(CUstream, &[CUdeviceptr]) -> Result<T, E> + Send,
) -> Result<T, String>
where
    T: Send,
    E: std::fmt::Display,
{
    let bindings = handles.iter().map(|h| h.clone().binding()).collect();
    let server = DeviceHandle::<CudaServer>::new(device.to_id());
    // `submit_blocking` runs the task with the calling thread's stream id current.
    let task = move |server: &mut CudaServer| {
        let stream_id = StreamId::current();
        let (stream, pointers) = server
            .raw_stream(stream_id, bindings)
            .map_err(|e| format!("CubeCL's stream for {stream_id}: {e:?}"))?;
        work(stream, &pointers).map_err(|e| e.to_string())
    };
    server
        .submit_blocking(task)
        .map_err(|_| format!("CubeCL's device thread for {device:?} did not run the task"))?
}
