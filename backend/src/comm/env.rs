//! Where this process sits in the job: rank, world size, local rank and the rendezvous address,
//! read from (in this order) explicit flags, torchrun's variables, Slurm's, OpenMPI's, or else a
//! single process.

use super::error::CommError;

/// The default rendezvous port, as torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    /// Explicit command-line flags.
    Flags,
    /// torchrun or `wildfire launch`: RANK, WORLD_SIZE, LOCAL_RANK, …
    Torchrun,
    /// Slurm's srun: SLURM_PROCID, SLURM_NTASKS, …
    Slurm,
    /// OpenMPI's mpirun: OMPI_COMM_WORLD_RANK, …
    OpenMpi,
    /// Nothing set: one process.
    Single,
}

/// Explicit settings (command-line flags); each overrides what the environment says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchFlags {
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub local_rank: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub source: LaunchSource,
}

impl LaunchEnv {
    /// Reads the process environment (see the module docs for the order).
    pub fn detect(flags: &LaunchFlags) -> Result<Self, CommError> {
        Self::from_vars(flags, |name| std::env::var(name).ok())
    }

    /// As [`detect`](Self::detect), with variables from `var` (for tests).
    pub fn from_vars(
        flags: &LaunchFlags,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, CommError> {
        let num = |name: &str| -> Result<Option<usize>, CommError> {
            var(name)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        CommError::Rendezvous(format!("{name}={v:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let port_var = |name: &str| -> Result<Option<u16>, CommError> {
            var(name)
                .map(|v| {
                    v.trim().parse::<u16>().map_err(|_| {
                        CommError::Rendezvous(format!(
                            "{name}={v:?} is not a port number (0-65535)"
                        ))
                    })
                })
                .transpose()
        };
        let master_port = match flags.master_port {
            Some(p) => p,
            None => port_var("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT),
        };
        let master_addr = flags.master_addr.clone().or_else(|| var("MASTER_ADDR"));

        let (source, rank, world_size, local_rank, local_world_size, default_addr) =
            if let (Some(rank), Some(world)) = (flags.rank, flags.world_size) {
                (
                    LaunchSource::Flags,
                    rank,
                    world,
                    flags.local_rank.unwrap_or(rank),
                    world,
                    None,
                )
            } else if let (Some(rank), Some(world)) = (num("RANK")?, num("WORLD_SIZE")?) {
                let local = num("LOCAL_RANK")?.unwrap_or(rank);
                let local_world = num("LOCAL_WORLD_SIZE")?.unwrap_or(world);
                (
                    LaunchSource::Torchrun,
                    rank,
                    world,
                    local,
                    local_world,
                    None,
                )
            } else if let (Some(rank), Some(world)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
                let local = num("SLURM_LOCALID")?.unwrap_or(0);
                let local_world = match var("SLURM_TASKS_PER_NODE") {
                    Some(v) => first_tasks_per_node(&v).unwrap_or(world),
                    None => world,
                };
                let first_host = match var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST")) {
                    Some(list) => expand_nodelist(&list)?.into_iter().next(),
                    None => None,
                };
                (
                    LaunchSource::Slurm,
                    rank,
                    world,
                    local,
                    local_world,
                    first_host,
                )
            } else if let (Some(rank), Some(world)) =
                (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?)
            {
                let local = num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0);
                let local_world = num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world);
                (LaunchSource::OpenMpi, rank, world, local, local_world, None)
            } else {
                (LaunchSource::Single, 0, 1, 0, 1, None)
            };
        let env = LaunchEnv {
            rank: flags.rank.unwrap_or(rank),
            world_size: flags.world_size.unwrap_or(world_size),
            local_rank: flags.local_rank.unwrap_or(local_rank),
            local_world_size,
            master_addr: master_addr
                .or(default_addr)
                .unwrap_or_else(|| "127.0.0.1".to_string()),
            master_port,
            source,
        };
        env.validate()?;
        Ok(env)
    }

    /// Rejects a world of size 0 and a rank outside the world.
    pub fn validate(&self) -> Result<(), CommError> {
        if self.world_size == 0 {
            return Err(CommError::InvalidGroup(format!(
                "world size 0 (from {:?}): a job needs at least one rank",
                self.source
            )));
        }
        if self.rank >= self.world_size {
            return Err(CommError::InvalidGroup(format!(
                "rank {} is not below the world size {} (from {:?})",
                self.rank, self.world_size, self.source
            )));
        }
        Ok(())
    }
}

/// The task count of the first node in SLURM_TASKS_PER_NODE ("4(x2),3" → 4).
fn first_tasks_per_node(value: &str) -> Option<usize> {
    let first = value.split(',').next()?;
    first.split('(').next()?.trim().parse().ok()
}

/// Expands a Slurm node list: `"node[01-03,07],gpu5"` → node01, node02, node03, node07, gpu5.
/// Several bracket groups in one name multiply out; zero padding is kept.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, CommError> {
    let bad =
        |why: &str| CommError::Rendezvous(format!("cannot parse Slurm node list {list:?}: {why}"));
    let mut hosts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(|| bad("unmatched ']'"))?,
            ',' if depth == 0 => {
                hosts.extend(expand_name(&list[start..i], &bad)?);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(bad("unmatched '['"));
    }
    hosts.extend(expand_name(&list[start..], &bad)?);
    Ok(hosts)
}

fn expand_name(name: &str, bad: &impl Fn(&str) -> CommError) -> Result<Vec<String>, CommError> {
    let name = name.trim();
    if name.is_empty() {
        return Err(bad("empty host name"));
    }
    let Some(open) = name.find('[') else {
        return Ok(vec![name.to_string()]);
    };
    let close = open + name[open..].find(']').ok_or_else(|| bad("unmatched '['"))?;
    let (prefix, ranges, rest) = (&name[..open], &name[open + 1..close], &name[close + 1..]);
    let suffixes = expand_name_or_empty(rest, bad)?;
    let mut out = Vec::new();
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let width = lo.len();
        let parse = |s: &str| {
            s.trim()
                .parse::<u64>()
                .map_err(|_| bad(&format!("{s:?} is not a number")))
        };
        let (lo_n, hi_n) = (parse(lo)?, parse(hi)?);
        if hi_n < lo_n {
            return Err(bad(&format!("range {range} goes backwards")));
        }
        for n in lo_n..=hi_n {
            for suffix in &suffixes {
                out.push(format!("{prefix}{n:0width$}{suffix}"));
            }
        }
    }
    Ok(out)
}

fn expand_name_or_empty(
    rest: &str,
    bad: &impl Fn(&str) -> CommError,
) -> Result<Vec<String>, CommError> {
    if rest.is_empty() {
        Ok(vec![String::new()])
    } else {
        expand_name(rest, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(flags: &LaunchFlags, vars: &[(&str, &str)]) -> Result<LaunchEnv, CommError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(flags, |k| map.get(k).cloned())
    }

    #[test]
    fn nodelists_expand_ranges_padding_and_groups() {
        assert_eq!(
            expand_nodelist("node[01-03,07],gpu5").expect("parse"),
            ["node01", "node02", "node03", "node07", "gpu5"]
        );
        assert_eq!(
            expand_nodelist("a[1-2]b[8-9]").expect("parse"),
            ["a1b8", "a1b9", "a2b8", "a2b9"]
        );
        assert_eq!(expand_nodelist("solo").expect("parse"), ["solo"]);
        assert!(expand_nodelist("n[1-").is_err());
        assert!(expand_nodelist("n[3-1]").is_err());
    }

    #[test]
    fn flags_win_over_torchrun_over_slurm_over_openmpi() {
        let all = [
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "8"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "16"),
        ];
        let flags = LaunchFlags {
            rank: Some(0),
            world_size: Some(2),
            ..Default::default()
        };
        let e = env_of(&flags, &all).expect("flags");
        assert_eq!(
            (e.source, e.rank, e.world_size, e.master_addr.as_str()),
            (LaunchSource::Flags, 0, 2, "10.0.0.1")
        );
        let e = env_of(&LaunchFlags::default(), &all).expect("torchrun");
        assert_eq!(
            (e.source, e.rank, e.world_size),
            (LaunchSource::Torchrun, 1, 4)
        );
        let e = env_of(&LaunchFlags::default(), &all[4..]).expect("slurm");
        assert_eq!(
            (e.source, e.rank, e.world_size),
            (LaunchSource::Slurm, 2, 8)
        );
        let e = env_of(&LaunchFlags::default(), &all[6..]).expect("ompi");
        assert_eq!(
            (e.source, e.rank, e.world_size),
            (LaunchSource::OpenMpi, 3, 16)
        );
        let e = env_of(&LaunchFlags::default(), &[]).expect("single");
        assert_eq!(
            (e.source, e.rank, e.world_size, e.master_port),
            (LaunchSource::Single, 0, 1, DEFAULT_MASTER_PORT)
        );
    }

    #[test]
    fn slurm_master_is_the_first_node_unless_master_addr_is_set() {
        let vars = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
        ];
        let e = env_of(&LaunchFlags::default(), &vars).expect("slurm");
        assert_eq!(
            (e.master_addr.as_str(), e.local_rank, e.local_world_size),
            ("gpu07", 1, 4)
        );
        let mut with_addr = vars.to_vec();
        with_addr.push(("MASTER_ADDR", "head"));
        assert_eq!(
            env_of(&LaunchFlags::default(), &with_addr)
                .expect("slurm")
                .master_addr,
            "head"
        );
    }

    #[test]
    fn bad_values_are_named() {
        let err = env_of(
            &LaunchFlags::default(),
            &[("RANK", "x"), ("WORLD_SIZE", "2")],
        )
        .expect_err("bad rank");
        assert!(err.to_string().contains("RANK=\"x\""), "{err}");
        let err = env_of(
            &LaunchFlags::default(),
            &[("RANK", "4"), ("WORLD_SIZE", "4")],
        )
        .expect_err("rank >= world");
        assert!(
            err.to_string()
                .contains("rank 4 is not below the world size 4"),
            "{err}"
        );
        let err = env_of(
            &LaunchFlags::default(),
            &[("RANK", "0"), ("WORLD_SIZE", "0")],
        )
        .expect_err("world 0");
        assert!(err.to_string().contains("world size 0"), "{err}");
        let err = env_of(&LaunchFlags::default(), &[("MASTER_PORT", "70000")]).expect_err("port");
        assert!(err.to_string().contains("MASTER_PORT=\"70000\""), "{err}");
    }
}
