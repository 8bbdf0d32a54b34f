//! The NCCL library, loaded at run time, and the rendezvous of an NCCL communicator's unique id.
//!
//! This is the host-side foundation of the NCCL transport (which runs collectives on CUDA device
//! buffers). It does not need CUDA to build, and its failure paths are tested on CPU machines.
//!
//! **Loading.** NCCL's real file name is `libnccl.so.2`; a `libnccl.so` symlink exists only where
//! the development package is installed, and pip's `nvidia-nccl-cu12` ships only `.so.2`.
//! cudarc's loader tries `libnccl.so`, `libnccl.so.<cuda major>` and a few other names, never
//! `libnccl.so.2`, and panics when none loads. So wildfire opens NCCL itself: the path in
//! `WILDFIRE_NCCL_LIB` when set, else `libnccl.so.2`, then `libnccl.so`, through the dynamic
//! loader's usual search (`LD_LIBRARY_PATH`, the ldconfig cache). Every symbol the transport uses
//! is resolved at load time, so a wrong library is refused with the missing symbol named, not
//! discovered in the middle of a collective.
//!
//! **Unique id.** An NCCL communicator is created from a 128-byte id made by one rank
//! (`ncclGetUniqueId`). Group rank 0 makes it and publishes it in the rendezvous store under a
//! key that names the group; the other ranks wait for it there, within the usual deadline.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;
use std::time::Duration;

use super::element::{ReduceOp, WireDType};
use super::error::CommError;
use super::store::StoreClient;

/// Environment variable naming the NCCL library file to load (overrides the search).
pub const NCCL_LIB_ENV: &str = "WILDFIRE_NCCL_LIB";

/// The file names tried, in order, when `WILDFIRE_NCCL_LIB` is not set.
pub const NCCL_LIB_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// Size of `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

impl UniqueId {
    pub fn to_bytes(&self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; UNIQUE_ID_BYTES] = bytes.try_into().ok()?;
        Some(Self {
            internal: bytes.map(|b| b as c_char),
        })
    }
}

/// An opaque `ncclComm_t`.
pub type RawComm = *mut c_void;
/// A `cudaStream_t` / `CUstream` (the same handle).
pub type RawStream = *mut c_void;

type Status = c_int;

/// `(send, recv, count, datatype, op or root, comm, stream)`: the shape of `ncclAllReduce`,
/// `ncclReduceScatter` and `ncclBroadcast`.
pub type CollectiveFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> Status;

/// `(send, recv, count, datatype, op, root, comm, stream)`: the shape of `ncclReduce`.
pub type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> Status;

/// The NCCL entry points the transport uses, resolved from one loaded library.
#[derive(Debug)]
pub struct NcclLibrary {
    /// The file that was loaded (as given to the dynamic loader).
    pub path: String,
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Status,
    pub comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> Status,
    pub comm_abort: unsafe extern "C" fn(RawComm) -> Status,
    pub comm_destroy: unsafe extern "C" fn(RawComm) -> Status,
    pub comm_get_async_error: unsafe extern "C" fn(RawComm, *mut Status) -> Status,
    pub get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> Status,
    pub all_reduce: CollectiveFn,
    pub reduce_scatter: CollectiveFn,
    pub all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        RawComm,
        RawStream,
    ) -> Status,
    /// The fifth argument is the root rank.
    pub broadcast: CollectiveFn,
    pub reduce: ReduceFn,
    pub send:
        unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> Status,
    pub recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Status,
    pub group_start: unsafe extern "C" fn() -> Status,
    pub group_end: unsafe extern "C" fn() -> Status,
}

// SAFETY: the struct holds plain function pointers into a library that stays loaded for the
// life of the process (it is never closed); NCCL's entry points may be called from any thread.
unsafe impl Send for NcclLibrary {}
// SAFETY: as above; nothing in the struct is mutated after loading.
unsafe impl Sync for NcclLibrary {}

/// The last `dlerror()` text, or a placeholder when there is none.
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a valid C string owned by the loader.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl* call on this thread.
        unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Resolves `name` in `handle` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the C signature of the symbol `name`.
unsafe fn symbol<F: Copy>(handle: *mut c_void, path: &str, name: &str) -> Result<F, String> {
    let c_name = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: handle is a live dlopen handle and c_name is NUL-terminated.
    let address = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
    if address.is_null() {
        return Err(format!(
            "{path} has no symbol {name}: it is not an NCCL library"
        ));
    }
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller guarantees F is the symbol's function-pointer type, which has the size
    // of a data pointer on every platform CUDA supports (checked above).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

impl NcclLibrary {
    /// Opens the first of `candidates` that loads and resolves every entry point. The error
    /// names every candidate with the reason it was refused.
    pub fn load_from(candidates: &[String]) -> Result<Self, String> {
        let mut refused = Vec::new();
        for path in candidates {
            match Self::load_one(path) {
                Ok(library) => return Ok(library),
                Err(reason) => refused.push(format!("{path}: {reason}")),
            }
        }
        Err(format!(
            "NCCL could not be loaded (tried {}); install NCCL (libnccl2) or set {NCCL_LIB_ENV} to \
             the path of libnccl.so.2",
            refused.join("; ")
        ))
    }

    fn load_one(path: &str) -> Result<Self, String> {
        let c_path = CString::new(path.as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: c_path is NUL-terminated; the handle is kept for the life of the process.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(dl_error());
        }
        // SAFETY: each type below is the C signature of the NCCL 2.x function it names.
        let library = unsafe {
            Self {
                path: path.to_string(),
                get_unique_id: symbol(handle, path, "ncclGetUniqueId")?,
                comm_init_rank: symbol(handle, path, "ncclCommInitRank")?,
                comm_abort: symbol(handle, path, "ncclCommAbort")?,
                comm_destroy: symbol(handle, path, "ncclCommDestroy")?,
                comm_get_async_error: symbol(handle, path, "ncclCommGetAsyncError")?,
                get_error_string: symbol(handle, path, "ncclGetErrorString")?,
                get_version: symbol(handle, path, "ncclGetVersion")?,
                all_reduce: symbol(handle, path, "ncclAllReduce")?,
                reduce_scatter: symbol(handle, path, "ncclReduceScatter")?,
                all_gather: symbol(handle, path, "ncclAllGather")?,
                broadcast: symbol(handle, path, "ncclBroadcast")?,
                reduce: symbol(handle, path, "ncclReduce")?,
                send: symbol(handle, path, "ncclSend")?,
                recv: symbol(handle, path, "ncclRecv")?,
                group_start: symbol(handle, path, "ncclGroupStart")?,
                group_end: symbol(handle, path, "ncclGroupEnd")?,
            }
        };
        Ok(library)
    }

    /// The candidates this process tries: `WILDFIRE_NCCL_LIB` alone when set, else
    /// [`NCCL_LIB_NAMES`].
    pub fn candidates() -> Vec<String> {
        match std::env::var(NCCL_LIB_ENV) {
            Ok(path) if !path.is_empty() => vec![path],
            _ => NCCL_LIB_NAMES.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The process's NCCL, loaded on first use (a failure is remembered and returned again).
    pub fn get() -> Result<&'static Self, CommError> {
        static LIBRARY: OnceLock<Result<NcclLibrary, String>> = OnceLock::new();
        LIBRARY
            .get_or_init(|| Self::load_from(&Self::candidates()))
            .as_ref()
            .map_err(|reason| CommError::Nccl(reason.clone()))
    }

    /// NCCL's version code (e.g. 22103 for 2.21.3).
    pub fn version(&self) -> Result<i32, CommError> {
        let mut version = 0;
        // SAFETY: get_version writes one int through the pointer.
        self.check("ncclGetVersion", unsafe {
            (self.get_version)(&mut version)
        })?;
        Ok(version)
    }

    /// A fresh unique id (`ncclGetUniqueId`).
    pub fn unique_id(&self) -> Result<UniqueId, CommError> {
        let mut id = UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: get_unique_id fills the 128-byte struct.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id)
    }

    /// `Ok` for `ncclSuccess`, else an error naming the call and NCCL's description.
    pub fn check(&self, call: &str, status: Status) -> Result<(), CommError> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static C string for any status.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(status)) };
        Err(CommError::Nccl(format!(
            "{call} failed with status {status}: {}",
            text.to_string_lossy()
        )))
    }
}

/// NCCL's `ncclDataType_t` for a wire type.
pub fn nccl_dtype(dtype: WireDType) -> c_int {
    match dtype {
        WireDType::U8 => 1,
        WireDType::I32 => 2,
        WireDType::I64 => 4,
        WireDType::F16 => 6,
        WireDType::F32 => 7,
        WireDType::F64 => 8,
        WireDType::BF16 => 9,
    }
}

/// NCCL's `ncclRedOp_t` for a reduction. Mean is `ncclAvg` (NCCL ≥ 2.10).
pub fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Mean => 4,
    }
}

/// The store key under which group `group` publishes its communicator's unique id.
pub fn unique_id_key(group: &str) -> String {
    format!("wildfire/nccl/{group}/unique-id")
}

/// The unique id of `group`'s communicator, agreed through the store: rank 0 calls `create`
/// and publishes the result; the other ranks wait for it, at most `timeout`.
pub fn share_unique_id(
    store: &StoreClient,
    group: &str,
    rank: usize,
    timeout: Duration,
    create: impl FnOnce() -> Result<UniqueId, CommError>,
) -> Result<UniqueId, CommError> {
    let key = unique_id_key(group);
    if rank == 0 {
        let id = create()?;
        store.set(&key, &id.to_bytes())?;
        return Ok(id);
    }
    let bytes = store.get_within(&key, timeout)?.ok_or_else(|| {
        CommError::Nccl(format!(
            "rank {rank} of {group} waited {:.1} s for rank 0's NCCL unique id (store key {key})",
            timeout.as_secs_f64()
        ))
    })?;
    UniqueId::from_bytes(&bytes).ok_or_else(|| {
        CommError::Nccl(format!(
            "store key {key} holds {} bytes, not a {UNIQUE_ID_BYTES}-byte NCCL unique id",
            bytes.len()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::StoreServer;
    use crate::comm::auth::JobToken;

    const LOOPBACK: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn connect(port: u16) -> StoreClient {
        StoreClient::connect(
            "127.0.0.1",
            port,
            Duration::from_secs(10),
            &JobToken::default(),
        )
        .unwrap()
    }

    #[test]
    fn a_missing_library_is_an_error_naming_every_candidate() {
        let candidates = vec![
            "/nonexistent/libnccl.so.2".to_string(),
            "libnccl-none.so".to_string(),
        ];
        let err = NcclLibrary::load_from(&candidates).unwrap_err();
        assert!(
            err.contains("/nonexistent/libnccl.so.2: ") && err.contains("libnccl-none.so: "),
            "{err}"
        );
        assert!(err.contains(NCCL_LIB_ENV), "{err}");
    }

    #[test]
    fn a_library_without_nccl_symbols_is_refused_by_name() {
        let err = NcclLibrary::load_from(&["libc.so.6".to_string()]).unwrap_err();
        assert!(
            err.contains("libc.so.6 has no symbol ncclGetUniqueId"),
            "{err}"
        );
    }

    #[test]
    fn unique_id_travels_through_the_store() {
        let server = StoreServer::start(LOOPBACK, 0, JobToken::default()).unwrap();
        let port = server.local_addr().port();
        let made = UniqueId {
            internal: std::array::from_fn(|i| (i as u8).wrapping_mul(7) as c_char),
        };
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let store = connect(port);
                    share_unique_id(&store, "world", rank, Duration::from_secs(10), || Ok(made))
                })
            })
            .collect();
        for handle in ranks {
            assert_eq!(handle.join().unwrap().unwrap(), made);
        }
        let store = connect(port);
        let err = share_unique_id(
            &store,
            "tp-0",
            1,
            Duration::from_millis(50),
            || unreachable!(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("rank 1 of tp-0 waited") && err.contains("wildfire/nccl/tp-0/unique-id"),
            "{err}"
        );
    }

    #[test]
    fn codes_match_nccl_h() {
        assert_eq!(
            [
                WireDType::U8,
                WireDType::I32,
                WireDType::I64,
                WireDType::F16,
                WireDType::F32,
                WireDType::F64,
                WireDType::BF16
            ]
            .map(nccl_dtype),
            [1, 2, 4, 6, 7, 8, 9]
        );
        assert_eq!(
            [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Mean].map(nccl_op),
            [0, 2, 3, 4]
        );
    }
}
