//! Joining a multi-process job: rendezvous through the store, then the TCP transport.

use std::sync::Arc;

use super::env::LaunchEnv;
use super::error::CommError;
use super::group::{CommOptions, ProcessGroup, Rendezvous};
use super::store::{StoreClient, StoreServer};
use super::transport::tcp::TcpTransport;

impl ProcessGroup {
    /// Joins the job described by `env` and returns the world group.
    ///
    /// Rank 0 serves the rendezvous store at `master_addr:master_port`; every rank publishes its
    /// listener there and connects to every other rank. A world of one needs no network. Fails,
    /// naming the values involved, on a bad rank or world size, an unreachable store, a port in
    /// use, or ranks that never arrive within `options.timeout`.
    pub fn init(env: &LaunchEnv, options: CommOptions) -> Result<Self, CommError> {
        env.validate()?;
        if env.world_size == 1 {
            return Ok(Self::local_world(1, options)?.remove(0));
        }
        let server = if env.rank == 0 {
            Some(StoreServer::start(env.master_port)?)
        } else {
            None
        };
        let store = StoreClient::connect(&env.master_addr, env.master_port, options.timeout)?;
        let transport = TcpTransport::connect(
            env.rank,
            env.world_size,
            env.local_world_size,
            &store,
            options.timeout,
        )?;
        let rendezvous = Rendezvous {
            store,
            _server: server,
        };
        Ok(Self::world(
            Arc::new(transport),
            options,
            Some(Arc::new(rendezvous)),
        ))
    }
}
