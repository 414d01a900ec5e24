//! The control API: HTTP/1.1 with JSON bodies on a Unix socket (root-only), served to the
//! `ratelimit` CLI (and `curl --unix-socket`).

use std::path::Path;

use crate::agent::{AgentError, SharedAgent};

/// Binds the control socket and serves the API until the task is aborted.
pub async fn serve(socket: &Path, agent: SharedAgent) -> Result<tokio::task::JoinHandle<()>, AgentError> {
    // TODO(api): routes.
    let _ = (socket, agent);
    Ok(tokio::spawn(std::future::pending()))
}
