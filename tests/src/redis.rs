//! A real `redis-server` for the tests of `[cluster] backend = "redis"`: started inside a test's
//! network namespace on an address the test created, with its own temporary directory and no
//! persistence (`--save "" --appendonly no`), killed on drop. [`RedisServer::restart`] starts it
//! again empty on the same address (Redis restarting without its data). [`RedisCluster`] is a
//! Redis Cluster of several masters on loopback in this process's namespace (the bench's `redis`
//! case drives it), on ports it picks free.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use crate::Netns;

/// A `redis-server` process in a test namespace (or, for [`RedisCluster`], in this one).
pub struct RedisServer {
    /// The namespace it runs in; `None`: this process's.
    ns_name: Option<String>,
    addr: SocketAddr,
    dir: PathBuf,
    args: Vec<String>,
    /// A `--cluster-enabled` server that serves every slot alone (else [`RedisCluster`] gives
    /// it its slots).
    one_node_cluster: bool,
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
            ns_name: Some(ns.name().to_string()),
            addr,
            dir,
            args: args.iter().map(ToString::to_string).collect(),
            one_node_cluster: args.contains(&"--cluster-enabled"),
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

    /// `program` run in its namespace.
    fn command(&self, program: &str) -> Command {
        match &self.ns_name {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, program]);
                c
            }
            None => Command::new(program),
        }
    }

    /// Its process id, while it runs.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn spawn(&mut self) -> Result<()> {
        let child = self
            .command("redis-server")
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
        if !self.one_node_cluster {
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
        let out = self
            .command("redis-cli")
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

/// A Redis Cluster of several masters on 127.0.0.1 in this process's namespace, each on a port
/// picked free (with its cluster bus port, +10000), in a temporary directory of its own; the
/// servers are killed and the directory removed on drop.
pub struct RedisCluster {
    servers: Vec<RedisServer>,
    dir: PathBuf,
}

impl RedisCluster {
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
            servers: Vec::new(),
            dir,
        };
        for port in free_ports(masters)? {
            let dir = cluster.dir.join(port.to_string());
            std::fs::create_dir_all(&dir)?;
            let conf = dir.join("nodes.conf");
            let mut s = RedisServer {
                ns_name: None,
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                dir,
                args: vec![
                    "--cluster-enabled".into(),
                    "yes".into(),
                    "--cluster-config-file".into(),
                    conf.display().to_string(),
                    "--cluster-node-timeout".into(),
                    "5000".into(),
                ],
                one_node_cluster: false,
                child: None,
            };
            s.spawn()?;
            cluster.servers.push(s);
        }
        cluster.form()?;
        Ok(cluster)
    }

    fn form(&self) -> Result<()> {
        let n = self.servers.len();
        for (i, s) in self.servers.iter().enumerate() {
            let (from, to) = (16384 * i / n, 16384 * (i + 1) / n - 1);
            s.cli(&[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &from.to_string(),
                &to.to_string(),
            ])?;
        }
        let first = &self.servers[0];
        for s in &self.servers[1..] {
            let (ip, port) = (s.addr.ip().to_string(), s.addr.port().to_string());
            first.cli(&["CLUSTER", "MEET", &ip, &port])?;
        }
        let start = Instant::now();
        let known = format!("cluster_known_nodes:{n}");
        while !self.servers.iter().all(|s| {
            s.cli(&["CLUSTER", "INFO"])
                .is_ok_and(|i| i.contains("cluster_state:ok") && i.contains(&known))
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
        self.servers.iter().map(RedisServer::url).collect()
    }

    /// The masters.
    #[must_use]
    pub fn servers(&self) -> &[RedisServer] {
        &self.servers
    }

    /// Its temporary directory (removed on drop).
    #[must_use]
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        self.servers.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `n` distinct loopback ports free now whose cluster bus port (+10000) is free too. Another
/// process may take one before the server binds it: the server then fails to start, which
/// [`RedisServer::spawn`] reports.
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
