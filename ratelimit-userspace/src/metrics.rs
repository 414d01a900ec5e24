//! The Prometheus metrics endpoint.

use std::net::SocketAddr;

use crate::agent::{AgentError, SharedAgent};

/// Serves `/metrics` on `addr` until the task is aborted.
pub async fn serve(addr: SocketAddr, agent: SharedAgent) -> Result<tokio::task::JoinHandle<()>, AgentError> {
    // TODO(metrics): prometheus-client registry.
    let _ = (addr, agent);
    Ok(tokio::spawn(std::future::pending()))
}
