//! Joining a multi-process job: rendezvous through the store, then the shared-memory transport
//! (ranks of one host) or the TCP one.

use std::net::{IpAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use super::auth::{JOB_TOKEN_ENV, JobToken};
use super::env::LaunchEnv;
use super::error::CommError;
use super::group::{CommOptions, ProcessGroup, Rendezvous};
use super::store::{StoreClient, StoreServer};
use super::transport::Transport;
use super::transport::shm::{Choice, ShmTransport, TRANSPORT_ENV};
use super::transport::tcp::{BIND_ENV, TcpTransport, bind_ip};

impl ProcessGroup {
    /// Joins the job described by `env` and returns the world group.
    ///
    /// Rank 0 serves the rendezvous store at `master_addr:master_port`, bound to that address
    /// only; through it, ranks of one host map each other's shared memory, or (another host, or
    /// shared memory unavailable) publish their listeners and connect to every other rank. Every
    /// connection proves it holds the job's secret (`WILDFIRE_JOB_TOKEN`, see `comm::auth`),
    /// which a job spanning hosts must have. A world of one needs no network. Fails, naming the
    /// values involved, on a bad rank or world size, a missing secret, an unreachable store, a
    /// port in use, or ranks that never arrive within `options.timeout`.
    pub fn init(env: &LaunchEnv, options: CommOptions) -> Result<Self, CommError> {
        env.validate()?;
        if env.world_size == 1 {
            return Ok(Self::local_world(1, options)?.remove(0));
        }
        let token = job_token(env)?;
        let server = if env.rank == 0 {
            Some(StoreServer::start(
                store_ip(env)?,
                env.master_port,
                token.clone(),
            )?)
        } else {
            None
        };
        let store =
            StoreClient::connect(&env.master_addr, env.master_port, options.timeout, &token)?;
        let transport = transport(env, &store, options.timeout, &token)?;
        let rendezvous = Rendezvous {
            store,
            _server: server,
        };
        Ok(Self::world(transport, options, Some(Arc::new(rendezvous))))
    }
}

/// Shared memory when every rank is on this host and can use it ([`TRANSPORT_ENV`] decides
/// otherwise), else tcp; `auto` says on rank 0 why shared memory was not used on one host.
fn transport(
    env: &LaunchEnv,
    store: &StoreClient,
    timeout: Duration,
    token: &JobToken,
) -> Result<Arc<dyn Transport>, CommError> {
    let choice = Choice::from_env()?;
    let one_host = env.world_size == env.local_world_size;
    let wanted = match choice {
        Choice::Tcp => Err(format!("{TRANSPORT_ENV}=tcp")),
        _ if !one_host => Err("the job spans hosts".to_string()),
        _ => Ok(()),
    };
    let job = env.master_port.to_string();
    let why_not = match ShmTransport::connect(env.rank, env.world_size, store, wanted, &job)? {
        Ok(shm) => return Ok(Arc::new(shm)),
        Err(why) => why,
    };
    match choice {
        Choice::Shm => {
            return Err(CommError::Rendezvous(format!(
                "{TRANSPORT_ENV}=shm, but shared memory cannot connect this job: {why_not}"
            )));
        }
        Choice::Auto if one_host && env.rank == 0 => {
            eprintln!("wildfire: shared memory unavailable ({why_not}); using the tcp transport");
        }
        _ => {}
    }
    let tcp = TcpTransport::connect(
        env.rank,
        env.world_size,
        env.local_world_size,
        store,
        timeout,
        token,
    )?;
    Ok(Arc::new(tcp))
}

/// The job's secret: required when the job spans hosts; without one (a single host, not started
/// by `wildfire launch`, which makes one) connections are not authenticated.
fn job_token(env: &LaunchEnv) -> Result<JobToken, CommError> {
    match JobToken::from_env() {
        Some(token) => Ok(token),
        None if env.world_size > env.local_world_size => Err(CommError::Rendezvous(format!(
            "this job spans hosts ({} ranks, {} on this one) and {JOB_TOKEN_ENV} is not set: \
             give every launcher the same secret (e.g. export {JOB_TOKEN_ENV}=$(openssl rand \
             -hex 32) before launching)",
            env.world_size, env.local_world_size
        ))),
        None => Ok(JobToken::default()),
    }
}

/// Where rank 0 serves the store: [`BIND_ENV`] when set, else the address `MASTER_ADDR`
/// resolves to (which must be one of this host's).
fn store_ip(env: &LaunchEnv) -> Result<IpAddr, CommError> {
    if let Some(ip) = bind_ip()? {
        return Ok(ip);
    }
    let host = env.master_addr.as_str();
    (host, env.master_port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .map(|addr| addr.ip())
        .ok_or_else(|| {
            CommError::Rendezvous(format!(
                "cannot resolve MASTER_ADDR={host} to an address to serve the store on; set \
                 {BIND_ENV} to one of this host's addresses"
            ))
        })
}
