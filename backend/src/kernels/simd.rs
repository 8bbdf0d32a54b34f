//! Which SIMD the CPU kernels take on this machine.
//!
//! gemm (Flex's matmuls and ours), pulp (the native loops of [`super::flex`]) and macerator
//! (Flex's elementwise ops and reductions) choose their code at run time: AVX-512 where the CPU
//! has it and the build includes it (wildfire-backend's `avx512` feature, on by default), else
//! AVX2 with FMA. A sum's rounding depends on the lanes it is split into, so two machines, or
//! one machine built both ways (`scripts/avx2-only.sh`), agree bitwise only on the same path.

/// The widest SIMD the CPU kernels use here: `"avx512"`, `"avx2"` (with FMA) or `"scalar"`
/// (x86-64 without FMA, or another architecture's own SIMD).
pub fn cpu_simd() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "avx2";
        }
    }
    "scalar"
}

#[cfg(test)]
mod tests {
    use super::cpu_simd;

    /// `scripts/avx2-only.sh` sets `WILDFIRE_EXPECT_CPU_SIMD=avx2`: a build that still took
    /// AVX-512 would not be testing what it says.
    #[test]
    fn the_build_takes_the_expected_simd_path() {
        let path = cpu_simd();
        println!("CPU kernels' SIMD: {path}");
        if let Ok(expected) = std::env::var("WILDFIRE_EXPECT_CPU_SIMD") {
            assert_eq!(path, expected, "WILDFIRE_EXPECT_CPU_SIMD={expected}");
        }
    }
}
