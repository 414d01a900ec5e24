//! Tells the service manager what the agent is doing: `READY=1` once it enforces (systemd's
//! `Type=notify` waits for it), `RELOADING=1`/`READY=1` around a SIGHUP reload and `STOPPING=1` on
//! the way out, on the datagram socket named by `$NOTIFY_SOCKET`. Without that variable (the agent
//! started by hand or by a test harness) every call does nothing.

/// The agent has loaded, installed its rules and attached: it enforces. `status` is the one-line
/// state `systemctl status` shows.
pub fn ready(status: &str) {
    send(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(status),
    ]);
}

/// A reload (SIGHUP) starts; [`ready`] follows when it is done, whatever its outcome.
pub fn reloading() {
    send(&[sd_notify::NotifyState::Reloading]);
}

/// The agent is shutting down.
pub fn stopping() {
    send(&[sd_notify::NotifyState::Stopping]);
}

fn send(states: &[sd_notify::NotifyState]) {
    // The variable stays set (`unset_env: false`): READY=1 is sent again after every reload.
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!(error = %e, "notifying the service manager ($NOTIFY_SOCKET)");
    }
}
