//! cuBLASLt's GEMM on CubeCL CUDA tensors, the vendor tier of [`crate::kernels::matmul`].
//!
//! A product `lhs [.., m, k] · rhs [.., k, n]` runs as the calls of its
//! [`GemmPlan`](crate::kernels::matmul::gemm_plan): the operands' memory read as it lies
//! (transposes as `op = T`, broadcast batches as zero strides), the output a fresh contiguous
//! tensor, each call enqueued on CubeCL's stream ([`super::stream::enqueue`]), accumulating in
//! f32 (`CUBLAS_COMPUTE_32F`, or `_FAST_TF32` when asked) with `α = 1`, `β = 0`. The algorithm
//! is cuBLASLt's heuristic's first choice for the call's descriptors and its operands' pointer
//! alignment, asked once per distinct call and kept; the workspace (32 MiB, what cuBLAS itself
//! uses on Hopper) comes from CubeCL's allocator for each product.
//!
//! The library is loaded at run time (`libcublasLt.so`, found as cudarc finds it: the loader's
//! path, where `scripts/gpu-check.sh` puts pip's `nvidia/cublas/lib`); where it is absent,
//! [`library`] says why and the caller's other tier runs.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::stream::enqueue;
use crate::kernels::matmul::gemm_plan::{GemmCall, GemmPlan, GemmTypes, StridedView, plan};

/// The workspace each product may use.
const WORKSPACE_BYTES: usize = 32 << 20;

/// Whether cuBLASLt loads in this process (looked for once), or why not.
pub fn library() -> Result<(), String> {
    static PRESENT: OnceLock<Result<(), String>> = OnceLock::new();
    PRESENT
        .get_or_init(|| {
            // SAFETY: only tries to open the library by its candidate names.
            match unsafe { sys::is_culib_present() } {
                true => Ok(()),
                false => Err("libcublasLt.so was not found on the loader's path".into()),
            }
        })
        .clone()
}

/// `lhs · rhs` by cuBLASLt, in `types`, or why not (the caller's other tier then runs): the
/// library is absent, or the operands' strides would need a copy.
pub fn matmul(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    types: GemmTypes,
) -> Result<CubeTensor<CudaRuntime>, String> {
    library()?;
    let [lhs_shape, rhs_shape] = [lhs, rhs].map(|t| t.shape().to_vec());
    let [lhs_strides, rhs_strides] = [lhs, rhs].map(|t| t.meta.strides().to_vec());
    let plan = plan(
        StridedView {
            shape: &lhs_shape,
            strides: &lhs_strides,
        },
        StridedView {
            shape: &rhs_shape,
            strides: &rhs_strides,
        },
    )?;
    let out = empty_device_contiguous_dtype(
        lhs.client.clone(),
        lhs.device.clone(),
        Shape::from(plan.out_shape.clone()),
        types.output,
    );
    let workspace = lhs.client.empty(WORKSPACE_BYTES);
    let handles = [
        rhs.handle.clone(),
        lhs.handle.clone(),
        out.handle.clone(),
        workspace,
    ];
    let device_index = lhs.device.index;
    enqueue(&lhs.device, &handles, move |stream, pointers| {
        // SAFETY: the pointers are the live buffers of `handles`, sized for `plan` (the plan
        // reads only elements inside the operands' views; the output is fresh and contiguous).
        unsafe { run(device_index, &plan, types, stream, pointers) }
    })?;
    Ok(out)
}

/// What the heuristic's choice depends on: the call without its offsets, the types, and the
/// alignment of `A`, `B` and `C`'s first elements.
type AlgorithmKey = (GemmCall, GemmTypes, [u32; 3]);

/// A cuBLASLt handle and the algorithms its heuristic chose, per [`AlgorithmKey`].
struct DeviceLibrary {
    handle: sys::cublasLtHandle_t,
    algorithms: HashMap<AlgorithmKey, sys::cublasLtMatmulAlgo_t>,
}

/// The largest power of two up to 256 bytes that divides `pointer`: cuBLASLt's heuristic assumes
/// 256-byte-aligned operands unless told otherwise, and an offset view of a buffer is less.
fn alignment(pointer: CUdeviceptr) -> u32 {
    1 << pointer.trailing_zeros().min(8)
}

// SAFETY: used only on the device's CubeCL thread, under the mutex below.
unsafe impl Send for DeviceLibrary {}

static LIBRARIES: Mutex<Option<HashMap<usize, DeviceLibrary>>> = Mutex::new(None);

/// Every call of `plan` on `stream`; `pointers` are rhs, lhs, output and workspace.
///
/// # Safety
/// The pointers must be device buffers on the current context holding the plan's operands.
unsafe fn run(
    device_index: usize,
    plan: &GemmPlan,
    types: GemmTypes,
    stream: CUstream,
    pointers: &[CUdeviceptr],
) -> Result<(), String> {
    let mut libraries = LIBRARIES.lock().unwrap_or_else(|e| e.into_inner());
    let libraries = libraries.get_or_insert_with(HashMap::new);
    let library = match libraries.entry(device_index) {
        std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
        std::collections::hash_map::Entry::Vacant(entry) => entry.insert(DeviceLibrary {
            handle: lt::create_handle().map_err(|e| format!("cublasLtCreate: {e:?}"))?,
            algorithms: HashMap::new(),
        }),
    };
    let [rhs, lhs, out, workspace] = [pointers[0], pointers[1], pointers[2], pointers[3]];
    let (input_size, output_size) = (types.input.size() as u64, types.output.size() as u64);
    for call in &plan.calls {
        let a = rhs + call.offset_a as u64 * input_size;
        let b = lhs + call.offset_b as u64 * input_size;
        let c = out + call.offset_c as u64 * output_size;
        // SAFETY: as the caller promised, for this call's slice of the buffers.
        unsafe { gemm(library, call, types, [a, b, c], workspace, stream) }?;
    }
    Ok(())
}

/// The descriptors of one call, destroyed when dropped.
struct Descriptors {
    matmul: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    preference: sys::cublasLtMatmulPreference_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created once and is destroyed once, here; a null one was never made.
        unsafe {
            if !self.matmul.is_null() {
                let _ = lt::destroy_matmul_desc(self.matmul);
            }
            for layout in self.layouts {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            if !self.preference.is_null() {
                let _ = lt::destroy_matmul_pref(self.preference);
            }
        }
    }
}

fn failed(what: &str) -> impl Fn(lt::CublasError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

fn data_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        _ => sys::cudaDataType::CUDA_R_32F,
    }
}

/// Sets attribute `attr` of a descriptor to `value`.
///
/// # Safety
/// `set` must be the setter of a live descriptor and `T` the attribute's type.
unsafe fn set<A, T>(
    set: impl FnOnce(A, *const c_void, usize) -> Result<(), lt::CublasError>,
    attr: A,
    value: T,
    what: &str,
) -> Result<(), String> {
    let pointer = &value as *const T as *const c_void;
    set(attr, pointer, size_of::<T>()).map_err(failed(what))
}

/// One strided-batched GEMM of the plan, `[a, b, c]` its operands' first elements.
///
/// # Safety
/// As [`run`], for this call.
unsafe fn gemm(
    library: &mut DeviceLibrary,
    call: &GemmCall,
    types: GemmTypes,
    [a, b, c]: [CUdeviceptr; 3],
    workspace: CUdeviceptr,
    stream: CUstream,
) -> Result<(), String> {
    let compute = match types.tf32 {
        true => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        false => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    let mut descriptors = Descriptors {
        matmul: std::ptr::null_mut(),
        layouts: [std::ptr::null_mut(); 3],
        preference: std::ptr::null_mut(),
    };
    descriptors.matmul = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
        .map_err(failed("cublasLtMatmulDescCreate"))?;
    // cuBLAS's `cublasOperation_t`, an `int`: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (cudarc's
    // cuBLASLt bindings do not carry the enum).
    let op = |transpose: bool| i32::from(transpose);
    let desc = descriptors.matmul;
    let set_desc =
        |attr, buf, size| unsafe { lt::set_matmul_desc_attribute(desc, attr, buf, size) };
    use sys::cublasLtMatmulDescAttributes_t as Desc;
    // SAFETY: the descriptor is live; the transposes are `cublasOperation_t` values.
    unsafe {
        set(
            set_desc,
            Desc::CUBLASLT_MATMUL_DESC_TRANSA,
            op(call.transpose_a),
            "TRANSA",
        )?;
        set(
            set_desc,
            Desc::CUBLASLT_MATMUL_DESC_TRANSB,
            op(call.transpose_b),
            "TRANSB",
        )?;
    }
    let shapes = [
        (types.input, call.layout_a(), call.lda, call.stride_a),
        (types.input, call.layout_b(), call.ldb, call.stride_b),
        (types.output, (call.m, call.n), call.ldc, call.stride_c),
    ];
    for (slot, (dtype, (rows, cols), ld, stride)) in shapes.into_iter().enumerate() {
        let layout =
            lt::create_matrix_layout(data_type(dtype), rows as u64, cols as u64, ld as i64)
                .map_err(failed("cublasLtMatrixLayoutCreate"))?;
        descriptors.layouts[slot] = layout;
        if call.batch > 1 {
            use sys::cublasLtMatrixLayoutAttribute_t as Layout;
            let set_layout = |attr, buf, size| unsafe {
                lt::set_matrix_layout_attribute(layout, attr, buf, size)
            };
            // SAFETY: the layout is live; the count is an i32 and the stride an i64.
            unsafe {
                let count = call.batch as i32;
                set(
                    set_layout,
                    Layout::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    count,
                    "BATCH_COUNT",
                )?;
                let offset = stride as i64;
                let what = "STRIDED_BATCH_OFFSET";
                set(
                    set_layout,
                    Layout::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    offset,
                    what,
                )?;
            }
        }
    }
    let [a_layout, b_layout, c_layout] = descriptors.layouts;

    let alignments = [a, b, c].map(alignment);
    let key = (
        GemmCall {
            offset_a: 0,
            offset_b: 0,
            offset_c: 0,
            ..*call
        },
        types,
        alignments,
    );
    let algorithm = match library.algorithms.get(&key) {
        Some(algorithm) => *algorithm,
        None => {
            descriptors.preference =
                lt::create_matmul_pref().map_err(failed("cublasLtMatmulPreferenceCreate"))?;
            let preference = descriptors.preference;
            let set_pref = |attr, buf, size| unsafe {
                lt::set_matmul_pref_attribute(preference, attr, buf, size)
            };
            use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
            let bytes = WORKSPACE_BYTES as u64;
            let [align_a, align_b, align_c] = alignments;
            // SAFETY: the preference is live; the workspace bound is a u64, the alignments u32.
            unsafe {
                set(
                    set_pref,
                    Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    bytes,
                    "WORKSPACE",
                )?;
                set(
                    set_pref,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    align_a,
                    "ALIGN_A",
                )?;
                set(
                    set_pref,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    align_b,
                    "ALIGN_B",
                )?;
                set(
                    set_pref,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    align_c,
                    "ALIGN_C",
                )?;
                set(
                    set_pref,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                    align_c,
                    "ALIGN_D",
                )?;
            }
            // SAFETY: every descriptor is live and describes this call.
            let heuristic = unsafe {
                lt::get_matmul_algo_heuristic(
                    library.handle,
                    desc,
                    a_layout,
                    b_layout,
                    c_layout,
                    c_layout,
                    preference,
                )
            }
            .map_err(failed("cublasLtMatmulAlgoGetHeuristic"))?;
            library.algorithms.insert(key, heuristic.algo);
            heuristic.algo
        }
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: the descriptors describe the buffers at `a`, `b`, `c`; the workspace holds
    // WORKSPACE_BYTES; everything is enqueued on `stream`, in CubeCL's order.
    unsafe {
        lt::matmul(
            library.handle,
            desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            a as *const c_void,
            a_layout,
            b as *const c_void,
            b_layout,
            c as *const c_void,
            c_layout,
            c as *mut c_void,
            c_layout,
            &algorithm,
            workspace as *mut c_void,
            WORKSPACE_BYTES,
            stream as sys::cudaStream_t,
        )
    }
    .map_err(failed("cublasLtMatmul"))
}
