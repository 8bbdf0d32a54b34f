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

/// One table of kernels as CubeCL wrote it: a row per kernel, longest time first.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTable {
    pub rows: Vec<KernelRow>,
    /// The sum of the kernels' times (the table's `Total` line).
    pub total: Duration,
}

/// One kernel of a [`KernelTable`]: its time, summed over its launches.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelRow {
    /// The kernel's name, short: CubeCL's type name without its generic arguments and runtime
    /// (`KernelBinop MulOp`, `MatmulEntry`, `ElemwiseFuse`).
    pub name: String,
    pub time: Duration,
    pub launches: u64,
}

impl std::fmt::Display for KernelTable {
    /// `kernel · time · launches · share` per row, aligned, then the total.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let width = (self.rows.iter().map(|r| r.name.len()))
            .chain([6])
            .max()
            .unwrap_or(6);
        let total = self.total.as_secs_f64().max(f64::MIN_POSITIVE);
        writeln!(
            f,
            "  {:<width$}  {:>10}  {:>8}  {:>6}",
            "kernel", "ms", "launches", "share"
        )?;
        for row in &self.rows {
            let ms = 1e3 * row.time.as_secs_f64();
            let share = 100.0 * row.time.as_secs_f64() / total;
            let name = &row.name;
            writeln!(
                f,
                "  {name:<width$}  {ms:>10.3}  {:>8}  {share:>5.1}%",
                row.launches
            )?;
        }
        let launches: u64 = self.rows.iter().map(|r| r.launches).sum();
        let ms = 1e3 * self.total.as_secs_f64();
        write!(
            f,
            "  {:<width$}  {ms:>10.3}  {launches:>8}  100.0%",
            "total"
        )
    }
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
/// where it ends. Its rows are `| name | time | launches | share |`; kernels whose short names
/// agree are one row.
fn table_in(text: &str) -> Option<(KernelTable, usize)> {
    let start = text.find("|⎺")?;
    let bottom = start + text[start..].find("|⎯")?;
    let end = bottom
        + text[bottom..]
            .find('\n')
            .map_or(text.len() - bottom, |n| n + 1);
    let mut rows: Vec<KernelRow> = Vec::new();
    let mut total = None;
    for line in text[start..bottom].lines() {
        let cells: Vec<&str> = line.split(" | ").map(str::trim).collect();
        // A row: `| name segments… | time | launches | ratio |`, the name's own ` | ` included.
        let [.., time, launches, _ratio] = cells.as_slice() else {
            continue;
        };
        let (Some(time), Ok(launches)) = (parse_duration(time), launches.parse::<u64>()) else {
            continue;
        };
        let name = short_name(&cells[..cells.len() - 3]);
        if name == "Total" {
            total = Some(time);
        } else if let Some(row) = rows.iter_mut().find(|r| r.name == name) {
            row.time += time;
            row.launches += launches;
        } else {
            rows.push(KernelRow {
                name,
                time,
                launches,
            });
        }
    }
    rows.sort_by_key(|row| std::cmp::Reverse(row.time));
    Some((
        KernelTable {
            rows,
            total: total?,
        },
        end,
    ))
}

/// A kernel's name from the segments of CubeCL's (`| `-joined, the first starting with `| `):
/// the kernel's type and an operation that qualifies it (`KernelBinop MulOp`), without the
/// generic arguments and the runtime that follow.
fn short_name(segments: &[&str]) -> String {
    let plain = |segment: &&str| {
        !segment.ends_with("Runtime")
            && !segment.starts_with("__")
            && ![
                "TensorArgs",
                "DynamicScalar",
                "DynamicSize",
                "f32",
                "f16",
                "bf16",
                "f64",
                "i32",
                "i64",
                "u32",
                "u8",
                "bool",
            ]
            .contains(segment)
    };
    let words: Vec<&str> = (segments.iter())
        .map(|s| s.trim_start_matches('|').trim())
        .take_while(|s| plain(s))
        .take(2)
        .collect();
    words.join(" ")
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

    /// A table as CubeCL 0.10's `Profiled` writes it (names shortened), after a per-kernel
    /// line.
    const WRITTEN: &str = "| 1.5ms      | ElemwiseFuse | WgpuRuntime\n\
|⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺| \n\
| Name                                 | Duration | Num Computed | Ratio |\n\
|⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼| \n\
| ElemwiseFuse | WgpuRuntime           | 1.5ms    | 3            | 75 %  |\n\
| MatmulEntry | TensorArgs | __Lhs | WgpuRuntime | 100µs    | 1            | 5 %   |\n\
| KernelBinop | MulOp | f32 | WgpuRuntime | 300µs  | 1            | 15 %  |\n\
| KernelBinop | MulOp | f16 | WgpuRuntime | 100µs  | 1            | 5 %   |\n\
|⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼| \n\
| Total                                | 2ms      | 6            | 100 % |\n\
|⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯| \n\
| 7µs        | next step's kernel\n";

    #[test]
    fn a_table_is_found_whole_with_its_rows_and_total() {
        let (table, end) = table_in(WRITTEN).expect("a table");
        assert_eq!(table.total, Duration::from_millis(2));
        let rows: Vec<(&str, u64)> = (table.rows.iter())
            .map(|r| (r.name.as_str(), r.launches))
            .collect();
        assert_eq!(
            rows,
            [
                ("ElemwiseFuse", 3),
                ("KernelBinop MulOp", 2),
                ("MatmulEntry", 1)
            ]
        );
        assert_eq!(
            table.rows[1].time,
            Duration::from_micros(400),
            "two rows made one"
        );
        assert!(WRITTEN[end..].starts_with("| 7µs"), "{:?}", &WRITTEN[end..]);
        assert!(table_in(&WRITTEN[end..]).is_none(), "only one table");
        let unfinished = &WRITTEN[..WRITTEN.find("| Total").unwrap()];
        assert!(
            table_in(unfinished).is_none(),
            "a table still being written"
        );
        let shown = table.to_string();
        assert!(shown.contains("KernelBinop MulOp"), "{shown}");
        let last: Vec<&str> = shown.lines().last().unwrap().split_whitespace().collect();
        assert_eq!(last, ["total", "2.000", "6", "100.0%"], "{shown}");
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
