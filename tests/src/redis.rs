//! A real `redis-server` for the tests of `[cluster] backend = "redis"`: started inside a test's
//! network namespace on an address the test created, with its own temporary directory and no
//! persistence (`--save "" --appendonly no`), killed on drop. [`RedisServer::restart`] starts it
//! again empty on the same address (Redis restarting without its data).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use crate::Netns;

/// A `redis-server` process in a test namespace.
pub struct RedisServer {
    ns_name: String,
    addr: SocketAddr,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts `redis-server` in `ns` listening on `addr` (an address of `ns`), and waits (up to
    /// 10 s) until it answers `PING`.
    pub fn start(ns: &Netns, addr: SocketAddr) -> Result<Self> {
        Self::start_with(ns, addr, &[])
    }

    /// [`RedisServer::start`] with more `redis-server` arguments (`--user ...`); with
    /// `--cluster-enabled yes` it is made a Redis Cluster of one node serving every slot, and
    /// waited on until the cluster is `ok`.
    pub fn start_with(ns: &Netns, addr: SocketAddr, args: &[&str]) -> Result<Self> {
        // Per namespace (their names are unique): tests of one process may run at once.
        let dir = std::env::temp_dir().join(format!("rl-redis-{}-{}", ns.name(), addr.port()));
        std::fs::create_dir_all(&dir)?;
        let mut s = Self {
            ns_name: ns.name().to_string(),
            addr,
            dir,
            args: args.iter().map(ToString::to_string).collect(),
            child: None,
        };
        s.spawn()?;
        Ok(s)
    }

    /// `redis://ADDR:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Its address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn spawn(&mut self) -> Result<()> {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns_name, "redis-server"])
            .args(["--bind", &self.addr.ip().to_string()])
            .args(["--port", &self.addr.port().to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--protected-mode", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--logfile", ""])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server (apt-get install redis-server)")?;
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if self.cli(&["PING"]).is_ok_and(|o| o.trim() == "PONG") {
                return self.form_cluster();
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    bail!("redis-server on {} exited: {status}", self.addr);
                }
            }
            if start.elapsed() > Duration::from_secs(10) {
                bail!("redis-server on {} did not answer within 10 s", self.addr);
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// For a cluster-enabled server: gives it every slot and waits (up to 10 s) until the
    /// cluster is `ok`. Nothing for a standalone one.
    fn form_cluster(&self) -> Result<()> {
        if !self.args.iter().any(|a| a == "--cluster-enabled") {
            return Ok(());
        }
        self.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"])?;
        let start = Instant::now();
        while !self
            .cli(&["CLUSTER", "INFO"])
            .is_ok_and(|i| i.contains("cluster_state:ok"))
        {
            if start.elapsed() > Duration::from_secs(10) {
                bail!(
                    "the one-node Redis Cluster on {} did not become ok",
                    self.addr
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Runs `redis-cli` against it (from its namespace) and returns its output.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns_name, "redis-cli"])
            .args(["-h", &self.addr.ip().to_string()])
            .args(["-p", &self.addr.port().to_string()])
            .args(args)
            .output()
            .context("running redis-cli")?;
        if !out.status.success() {
            bail!(
                "redis-cli {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Kills it (SIGKILL: its data is gone, as in a crash).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether it runs.
    #[must_use]
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills it and starts it again, empty, on the same address.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.spawn()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
