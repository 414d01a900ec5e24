//! A Redis Cluster of several masters on loopback in this process's namespace (the bench's
//! `redis` case drives it): real `redis-server` processes on ports picked free, each with its
//! cluster bus port (+10000), no persistence, in a temporary directory of their own; killed and
//! removed on drop. The tests' servers in network namespaces are in [`crate::redis`].

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

/// The masters of a Redis Cluster on 127.0.0.1.
pub struct LocalRedisCluster {
    nodes: Vec<(SocketAddr, Child)>,
    dir: PathBuf,
}

impl LocalRedisCluster {
    /// Starts `masters` (1 to 16) cluster-enabled servers, splits the 16,384 slots evenly between
    /// them, introduces them (`CLUSTER MEET`) and waits (up to 20 s) until every one reports the
    /// cluster `ok` and knows the others. `tag` goes into the directory's name.
    pub fn start(masters: usize, tag: &str) -> Result<Self> {
        if !(1..=16).contains(&masters) {
            bail!("a local Redis Cluster has 1 to 16 masters (asked for {masters})");
        }
        let dir =
            std::env::temp_dir().join(format!("rl-redis-cluster-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
        };
        for port in free_ports(masters)? {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            let dir = cluster.dir.join(port.to_string());
            std::fs::create_dir_all(&dir)?;
            let child = Command::new("redis-server")
                .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--protected-mode", "no", "--daemonize", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"])
                .arg("--cluster-config-file")
                .arg(dir.join("nodes.conf"))
                .arg("--dir")
                .arg(&dir)
                .args(["--logfile", ""])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting redis-server (apt-get install redis-server)")?;
            cluster.nodes.push((addr, child));
        }
        cluster.form()?;
        Ok(cluster)
    }

    // Stays whole: started, given slots, introduced, waited on, in order.
    fn form(&mut self) -> Result<()> {
        let n = self.nodes.len();
        let start = Instant::now();
        for i in 0..n {
            while !self.cli(i, &["PING"]).is_ok_and(|o| o.trim() == "PONG") {
                if let Ok(Some(status)) = self.nodes[i].1.try_wait() {
                    bail!("redis-server on {} exited: {status}", self.nodes[i].0);
                }
                if start.elapsed() > Duration::from_secs(10) {
                    bail!(
                        "redis-server on {} did not answer within 10 s",
                        self.nodes[i].0
                    );
                }
                thread::sleep(Duration::from_millis(50));
            }
        }
        for i in 0..n {
            let (from, to) = (16384 * i / n, 16384 * (i + 1) / n - 1);
            self.cli(
                i,
                &[
                    "CLUSTER",
                    "ADDSLOTSRANGE",
                    &from.to_string(),
                    &to.to_string(),
                ],
            )?;
        }
        for i in 1..n {
            let port = self.nodes[i].0.port().to_string();
            self.cli(0, &["CLUSTER", "MEET", "127.0.0.1", &port])?;
        }
        let known = format!("cluster_known_nodes:{n}");
        while !(0..n).all(|i| {
            self.cli(i, &["CLUSTER", "INFO"])
                .is_ok_and(|s| s.contains("cluster_state:ok") && s.contains(&known))
        }) {
            if start.elapsed() > Duration::from_secs(20) {
                bail!("the Redis Cluster of {n} masters did not become ok within 20 s");
            }
            thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// `redis://127.0.0.1:PORT` of every master (seeds for a client).
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|(a, _)| format!("redis://{a}"))
            .collect()
    }

    /// How many masters.
    #[must_use]
    pub fn masters(&self) -> usize {
        self.nodes.len()
    }

    /// Runs `redis-cli` against master `i` and returns its output.
    pub fn cli(&self, i: usize, args: &[&str]) -> Result<String> {
        let addr = self.nodes.get(i).context("no such master")?.0;
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &addr.port().to_string()])
            .args(args)
            .output()
            .context("running redis-cli")?;
        if !out.status.success() {
            bail!(
                "redis-cli {args:?} on {addr}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Its temporary directory (removed on drop).
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for LocalRedisCluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.nodes {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `n` distinct loopback ports free now whose cluster bus port (+10000) is free too. Another
/// process may take one before the server binds it: the server then exits, which
/// [`LocalRedisCluster::start`] reports.
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let mut ports: Vec<u16> = Vec::new();
    for _ in 0..200 {
        if ports.len() == n {
            break;
        }
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let port = l.local_addr()?.port();
        let bus_free = port
            .checked_add(10_000)
            .is_some_and(|b| TcpListener::bind((Ipv4Addr::LOCALHOST, b)).is_ok());
        if bus_free && !ports.contains(&port) {
            ports.push(port);
        }
    }
    if ports.len() < n {
        bail!("found only {} of {n} free loopback port pairs", ports.len());
    }
    Ok(ports)
}
