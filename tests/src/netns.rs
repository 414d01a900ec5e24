//! Throwaway network namespaces: created with a unique name, deleted on drop, and a way to run
//! closures (and so create sockets) inside one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;

use anyhow::{bail, Context, Result};

use crate::cmd;

/// Process-wide counter behind every unique name this crate makes (namespaces and interfaces).
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// `ip netns add` mounts /run/netns on first use; two first uses at once can race, so this process
/// creates and deletes namespaces one at a time (each takes a few milliseconds).
static NETNS_LOCK: Mutex<()> = Mutex::new(());

/// A fresh, process-unique number.
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// A named network namespace (`ip netns add`), deleted when dropped.
///
/// Deleting the namespace destroys the interfaces inside it (a veth pair dies with either end), but
/// the kernel keeps the namespace alive while anything still holds it: drop sockets made with
/// [`in_netns`] (senders, [`crate::Receiver`]s) before the `Netns`, or its interfaces linger
/// unnamed until they close.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a namespace named `{prefix}-{pid}-{counter}`, unique across threads and processes.
    ///
    /// `prefix` must be non-empty ASCII letters, digits, `_` or `-`, so that
    /// [`leftover_check`]`(prefix)` finds what was left behind.
    pub fn new(prefix: &str) -> Result<Netns> {
        if prefix.is_empty()
            || prefix.len() > 32
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            bail!("namespace prefix {prefix:?}: want 1-32 ASCII letters, digits, '_' or '-'");
        }
        let name = format!("{prefix}-{}-{}", std::process::id(), next_id());
        let _guard = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        cmd::ip(&["netns", "add", &name])?;
        let ns = Netns { name };
        // Loopback starts down in a new namespace; tests expect 127.0.0.1 and ::1 to work.
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name, as `ip netns list` shows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bind-mounted namespace file that `setns` opens.
    pub fn path(&self) -> PathBuf {
        netns_path(&self.name)
    }

    /// Runs `ip netns exec NAME args...` and returns its stdout; the error names the command and
    /// carries its stderr.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["netns", "exec", self.name.as_str()];
        full.extend_from_slice(args);
        cmd::ip(&full)
    }

    /// Runs `ip -n NAME args...` and returns its stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        cmd::ip(&full)
    }

    /// Writes a sysctl inside the namespace, e.g. `("net/ipv6/conf/all/forwarding", "1")`.
    /// `net.*` sysctls are per namespace. The key is a path under /proc/sys (dotted keys are not
    /// accepted: interface names may contain dots).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let path = format!("/proc/sys/{key}");
        in_netns(self, || std::fs::write(&path, value))
            .with_context(|| format!("sysctl {key}={value} in namespace {}", self.name))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _guard = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = cmd::ip(&["netns", "del", &self.name]) {
            // Drop cannot fail; leftover_check in the test reports the leak.
            eprintln!(
                "ratelimit-testbed: cannot delete namespace {}: {e:#}",
                self.name
            );
        }
    }
}

fn netns_path(name: &str) -> PathBuf {
    // iproute2 uses /run/netns; /var/run is a symlink to /run on every current distribution.
    let run = PathBuf::from("/run/netns").join(name);
    if run.exists() {
        run
    } else {
        PathBuf::from("/var/run/netns").join(name)
    }
}

/// Runs `f` on a new thread that has entered `ns`'s network namespace, and returns its result.
///
/// Only that thread switches namespace (`setns(CLONE_NEWNET)` is per thread), so the caller and
/// the rest of the process are untouched. A socket is bound to the namespace it was *created* in
/// for its whole life, so a socket made inside `f` can be returned and used from any thread:
/// `let sock = in_netns(&ns, || UdpSocket::bind(addr))?;`. The same holds for anything else read
/// through the thread's namespace, such as `/proc/sys/net` or `/proc/thread-self/net`.
///
/// # Panics
/// If the namespace cannot be entered (it was deleted, or we lack `CAP_SYS_ADMIN`), or if `f`
/// panics (the panic is passed on).
pub fn in_netns<T: Send>(ns: &Netns, f: impl FnOnce() -> T + Send) -> T {
    in_netns_at(&ns.path(), f)
}

/// [`in_netns`] for a namespace given by its file (for holders that outlive a borrow of `Netns`).
pub(crate) fn in_netns_at<T: Send>(path: &Path, f: impl FnOnce() -> T + Send) -> T {
    let file = File::open(path)
        .unwrap_or_else(|e| panic!("cannot open namespace file {}: {e}", path.display()));
    thread::scope(|s| {
        let handle = s.spawn(move || {
            // SAFETY: plain syscall on a valid, open fd; it changes only this thread's namespace.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                panic!(
                    "setns({}) failed: {}",
                    path.display(),
                    std::io::Error::last_os_error()
                );
            }
            drop(file);
            f()
        });
        handle
            .join()
            .unwrap_or_else(|payload| std::panic::resume_unwind(payload))
    })
}

/// Names of namespaces (`ip netns list`) starting with `prefix`: what a test left behind.
///
/// Tests running in parallel may share a prefix: give each test its own prefix, or check one
/// namespace exactly with [`netns_exists`].
pub fn leftover_check(prefix: &str) -> Vec<String> {
    let listing = match cmd::ip(&["netns", "list"]) {
        Ok(listing) => listing,
        Err(e) => return vec![format!("<cannot list namespaces: {e:#}>")],
    };
    listing
        .lines()
        // Lines read "name" or "name (id: 3)".
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| name.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

/// Asserts that no namespace of this process whose name starts with `prefix` is left. Names
/// made per process carry its id (`-PID-`), so another test binary's run with the same prefix,
/// under way at the same time, is not counted.
pub fn assert_none_left(prefix: &str) {
    let ours = format!("-{}-", std::process::id());
    let left: Vec<String> = leftover_check(prefix)
        .into_iter()
        .filter(|n| n.contains(&ours))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

/// Whether a namespace of exactly this name exists (`ip netns list`).
pub fn netns_exists(name: &str) -> bool {
    leftover_check(name).iter().any(|n| n == name)
}
