//! A real `redis-server` for the tests of `[cluster] backend = "redis"`: started inside a test's
//! network namespace on an address the test created, with its own temporary directory and no
//! persistence (`--save "" --appendonly no`), killed on drop. [`RedisServer::restart`] starts it
//! again empty on the same address (Redis restarting without its data). [`RedisCluster`] is a
//! Redis Cluster of such servers, masters with a replica each, formed by `redis-cli --cluster
//! create`, whose masters can be killed to make a shard fail over.

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
    /// A cluster-enabled server made a cluster of its own (every slot); not for a node of a
    /// [`RedisCluster`].
    alone: bool,
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
        Self::spawn_new(ns, addr, args, true)
    }

    fn spawn_new(ns: &Netns, addr: SocketAddr, args: &[&str], alone: bool) -> Result<Self> {
        // Per namespace (their names are unique): tests of one process may run at once.
        let dir = std::env::temp_dir().join(format!("rl-redis-{}-{}", ns.name(), addr.port()));
        std::fs::create_dir_all(&dir)?;
        let mut s = Self {
            ns_name: ns.name().to_string(),
            addr,
            dir,
            args: args.iter().map(ToString::to_string).collect(),
            alone,
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
        if !self.alone || !self.args.iter().any(|a| a == "--cluster-enabled") {
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

/// A Redis Cluster in a test namespace: `masters` masters, each with one replica, on one address
/// and consecutive ports, with a node timeout of 1 s (a killed master's replica is promoted a
/// second or two after), formed by `redis-cli --cluster create`. Every node is killed on drop.
pub struct RedisCluster {
    /// The nodes: the masters first as created, then their replicas (roles change on failover).
    pub nodes: Vec<RedisServer>,
}

/// One line of `CLUSTER NODES`.
struct ClusterNode {
    id: String,
    addr: SocketAddr,
    /// A master, not failed.
    master: bool,
    /// A replica's master's id (`-` for a master).
    master_id: String,
    /// The slot ranges a master serves (`0-5460 ...`).
    slots: String,
}

impl RedisCluster {
    /// Starts the nodes in `ns` at `ip` from `first_port` on, forms the cluster and waits (up to
    /// 20 s) until every node sees it `ok` and every replica has synced with its master.
    pub fn start(
        ns: &Netns,
        ip: std::net::IpAddr,
        first_port: u16,
        masters: usize,
    ) -> Result<Self> {
        let mut nodes = Vec::new();
        for i in 0..2 * masters {
            let port = first_port + u16::try_from(i)?;
            nodes.push(RedisServer::spawn_new(
                ns,
                SocketAddr::new(ip, port),
                &["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"],
                false,
            )?);
        }
        let mut create = Command::new("ip");
        create
            .args([
                "netns",
                "exec",
                ns.name(),
                "redis-cli",
                "--cluster",
                "create",
            ])
            .args(nodes.iter().map(|n| n.addr.to_string()))
            .args(["--cluster-replicas", "1", "--cluster-yes"]);
        let out = create
            .output()
            .context("running redis-cli --cluster create")?;
        if !out.status.success() {
            bail!(
                "redis-cli --cluster create: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let c = Self { nodes };
        let start = Instant::now();
        while !c.nodes.iter().all(|n| {
            n.cli(&["CLUSTER", "INFO"])
                .is_ok_and(|i| i.contains("cluster_state:ok"))
                && n.cli(&["INFO", "replication"])
                    .is_ok_and(|r| r.contains("role:master") || r.contains("master_link_status:up"))
        }) {
            if start.elapsed() > Duration::from_secs(20) {
                bail!("the Redis Cluster did not become ok within 20 s");
            }
            thread::sleep(Duration::from_millis(100));
        }
        Ok(c)
    }

    /// `redis://ADDR:PORT` of every node.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// `CLUSTER NODES` as a running node sees it.
    fn cluster_nodes(&self) -> Result<Vec<ClusterNode>> {
        let n = self
            .nodes
            .iter()
            .find(|n| n.running())
            .context("no node runs")?;
        let text = n.cli(&["CLUSTER", "NODES"])?;
        let mut out = Vec::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                continue;
            }
            let addr: SocketAddr = f[1]
                .split('@')
                .next()
                .unwrap_or_default()
                .parse()
                .with_context(|| format!("CLUSTER NODES: {line}"))?;
            let master = f[2].contains("master") && !f[2].contains("fail");
            out.push(ClusterNode {
                id: f[0].to_string(),
                addr,
                master,
                master_id: f[3].to_string(),
                slots: f[8..].join(" "),
            });
        }
        Ok(out)
    }

    /// The index of the master serving `key`'s slot, and of its replica.
    pub fn shard_of(&self, key: &str) -> Result<(usize, usize)> {
        let n = self
            .nodes
            .iter()
            .find(|n| n.running())
            .context("no node runs")?;
        let slot: u16 = n.cli(&["CLUSTER", "KEYSLOT", key])?.trim().parse()?;
        let nodes = self.cluster_nodes()?;
        let serves = |ranges: &str| {
            ranges.split_whitespace().any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                a.parse::<u16>().is_ok_and(|a| a <= slot)
                    && b.parse::<u16>().is_ok_and(|b| slot <= b)
            })
        };
        let (id, addr) = nodes
            .iter()
            .find(|n| n.master && serves(&n.slots))
            .map(|n| (n.id.clone(), n.addr))
            .with_context(|| format!("no master serves slot {slot}"))?;
        let replica = nodes
            .iter()
            .find(|n| n.master_id == id)
            .map(|n| n.addr)
            .with_context(|| format!("the master of slot {slot} has no replica"))?;
        let index = |a: SocketAddr| {
            self.nodes
                .iter()
                .position(|n| n.addr == a)
                .with_context(|| format!("{a} is not a node of this cluster"))
        };
        Ok((index(addr)?, index(replica)?))
    }

    /// Whether node `i` is a master now (`ROLE`).
    #[must_use]
    pub fn is_master(&self, i: usize) -> bool {
        self.nodes[i]
            .cli(&["ROLE"])
            .is_ok_and(|r| r.lines().next() == Some("master"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
