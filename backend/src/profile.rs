//! Where a few steps spend their device time, from CubeCL's profiling logger: CubeCL times every
//! kernel it launches and, at each `sync` of a device, writes the table of the kernels that ran
//! since the previous one (name, total time, launches, share of the total), then starts a new
//! one.
//!
//! [`profile_kernels_into`] turns it on for this process with its output in a file. It must come
//! before the first CubeCL device, because CubeCL reads its configuration once. The caller syncs
//! the device at the end of each step it wants a table of, and reads that table back with
//! [`next_table`].
//!
//! Profiling costs. On CUDA, CubeCL synchronises before and after every kernel to time it: its
//! times are wall times around each kernel, and the device never runs ahead of the host while it
//! profiles. On wgpu it uses the adapter's timestamp queries where it has them. Under Burn's
//! fusion a fused block of elementwise ops is one kernel (`ElemwiseFuse`); wildfire's kernels
//! appear under their own names.

use std::path::Path;
use std::time::{Duration, Instant};

use cubecl::config::cache::CacheConfig;
use cubecl::config::profiling::ProfilingLogLevel;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// Turns CubeCL's kernel profiling on for this process, its tables written to `file` (which it
/// replaces), keeping the compiled kernels as [`crate::device::keep_compiled_kernels`] does.
/// An error when CubeCL has read its configuration already.
pub fn profile_kernels_into(file: &Path) -> Result<(), String> {
    let mut state = CubeClRuntimeConfig::storage().lock();
    if state.is_some() {
        return Err(format!(
            "cannot profile kernels into {}: CubeCL has read its configuration already (profiling \
             must be turned on before the first device)",
            file.display()
        ));
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.compilation.cache.get_or_insert(CacheConfig::Target);
    let logger = &mut config.profiling.logger;
    logger.level = ProfilingLogLevel::Basic;
    logger.file = Some(file.to_path_buf());
    logger.append = false;
    *state = Some(std::sync::Arc::new(config));
    Ok(())
}

/// One table of kernels as CubeCL wrote it, and its total kernel time.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTable {
    /// The table's lines: a header, one line per kernel (`| name | time | launches | share |`,
    /// longest time first), and the total.
    pub text: String,
    /// The sum of the kernels' times (the `Total` line).
    pub total: Duration,
}

/// The first whole table in `file` after byte `from`, waiting up to `timeout` for CubeCL's
/// logging thread to write it (it writes after the `sync` that asked for it returns); the
/// table, and the byte where the next read starts.
pub fn next_table(
    file: &Path,
    from: usize,
    timeout: Duration,
) -> Result<(KernelTable, usize), String> {
    let started = Instant::now();
    loop {
        let text = std::fs::read(file)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .map_err(|e| format!("cannot read the kernel profile {}: {e}", file.display()))?;
        if let Some(found) = text.get(from..).and_then(table_in) {
            let (table, end) = found;
            return Ok((table, from + end));
        }
        if started.elapsed() > timeout {
            return Err(format!(
                "no table of kernels in {} after byte {from} within {timeout:?}",
                file.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The first whole table in `text` (from its top rule `|⎺…` to its bottom rule `|⎯…`), and
/// where it ends.
fn table_in(text: &str) -> Option<(KernelTable, usize)> {
    let start = text.find("|⎺")?;
    let bottom = start + text[start..].find("|⎯")?;
    let end = bottom
        + text[bottom..]
            .find('\n')
            .map_or(text.len() - bottom, |n| n + 1);
    let table = &text[start..end];
    let total = table
        .lines()
        .find_map(|line| line.strip_prefix("| Total"))
        .and_then(|rest| rest.split('|').nth(1))
        .and_then(|time| parse_duration(time.trim()))?;
    Some((
        KernelTable {
            text: table.to_string(),
            total,
        },
        end,
    ))
}

/// A duration as Rust's `Debug` writes it: `850ns`, `12.5µs`, `1.234567ms`, `2.5s`.
fn parse_duration(text: &str) -> Option<Duration> {
    let units = [("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)];
    let (number, scale) = units
        .iter()
        .find_map(|(unit, scale)| text.strip_suffix(unit).map(|n| (n, *scale)))?;
    let seconds = number.parse::<f64>().ok()? * scale;
    (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table as CubeCL 0.10's `Profiled` writes it, after a per-kernel line.
    const WRITTEN: &str = "| 1.5ms      | ElemwiseFuse | WgpuRuntime\n\
|⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺| \n\
| Name                | Duration | Num Computed | Ratio |\n\
|⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼| \n\
| ElemwiseFuse        | 1.5ms    | 3            | 75 %  |\n\
| MatmulEntry         | 500µs    | 1            | 25 %  |\n\
|⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼| \n\
| Total               | 2ms      | 4            | 100 % |\n\
|⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯| \n\
| 7µs        | next step's kernel\n";

    #[test]
    fn a_table_is_found_whole_with_its_total() {
        let (table, end) = table_in(WRITTEN).expect("a table");
        assert_eq!(table.total, Duration::from_millis(2));
        assert!(table.text.starts_with("|⎺") && table.text.contains("MatmulEntry"));
        assert!(WRITTEN[end..].starts_with("| 7µs"), "{:?}", &WRITTEN[end..]);
        assert!(table_in(&WRITTEN[end..]).is_none(), "only one table");
        let unfinished = &WRITTEN[..WRITTEN.find("| Total").unwrap()];
        assert!(
            table_in(unfinished).is_none(),
            "a table still being written"
        );
    }

    #[test]
    fn durations_parse_as_debug_writes_them() {
        for duration in [
            Duration::from_nanos(850),
            Duration::from_nanos(12_500),
            Duration::from_nanos(1_234_567),
            Duration::from_millis(2_500),
        ] {
            let parsed = parse_duration(&format!("{duration:?}")).unwrap();
            let error = parsed.as_secs_f64() - duration.as_secs_f64();
            assert!(error.abs() < 1e-12, "{duration:?} read as {parsed:?}");
        }
        assert_eq!(parse_duration("fast"), None);
    }
}
