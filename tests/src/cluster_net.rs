//! The one cluster test network, for every cluster end-to-end test and the bench: [`ClusterNet`],
//! a switch namespace with a data bridge and a gossip bridge, a sender namespace, and N host
//! namespaces, each with the limiter attached to its data link and gossiping on its own link (so a
//! partition is one `ip link set down`), the hosts' MACs pinned in the bridge and static
//! neighbours from the sender to each host, and the cluster key file. On top of it: more source
//! addresses for the sender ([`ClusterNet::add_source`]), gossip-only namespaces on the gossip
//! bridge (an attacker's, [`ClusterNet::gossip_only`]), more key files
//! ([`ClusterNet::write_key`]), static neighbours between the hosts' gossip links
//! ([`ClusterNet::pin_gossip_neighbours`]); the hosts' configs and agents, a Redis store on the
//! gossip bridge, and the floods: one paced sender thread spreads a source's flood over the hosts
//! following a schedule of splits, and [`Samples`] turns what each host delivered into the
//! cluster's admitted rate over any window.
//!
//! ```text
//!   sw namespace: bridge "rlbd" (data, 198.18.0.0/24), bridge "rlbg" (gossip, 198.18.1.0/24)
//!   tx --data-- rlbd --data-- h0 .. hN-1
//!               rlbg --gossip-- h0 .. hN-1 (and gossip-only namespaces)
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::{
    add_addr, agent_binary, bind_udp, ifindex, mac, mac_bytes, neigh_to_peer, veth_pair,
    AgentProcess, Netns, RawSocket, Receiver,
};

mod samples;

pub use self::samples::{stalls, Convergence, LowestWindow, Sample, Samples, Stall, Stalled};

/// The flood source every [`ClusterNet`] can send from.
pub const FLOOD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 250);
/// The gossip port of every host.
pub const GOSSIP_PORT: u16 = 7946;
/// The port the hosts' receivers listen on.
pub const DATA_PORT: u16 = 9000;
/// The cluster key's secret (base64 text, as in a key file).
pub const SECRET: &str = "k8Qx2v9Lm4Tz7Rb1Nc6Yh3Wd5Gf0Ps8Ju2Ea4Ko7Ui1";
/// Most hosts (addresses 198.18.{0,1}.1..=200).
pub const MAX_HOSTS: usize = 200;
/// The `[agent]` line every agent of the bed gets: no learner. Each learning agent walks its
/// whole bucket store (64 MiB at the default `max_buckets`) once a second, paced to at most a
/// tenth of a core: a host's own cost, but 8 agents on the 2 cores of a test machine multiply it
/// (with it, one CI run of the 8-host gossip scenario had rounds 0.6 s overdue and read 0.67 x
/// the budget 1.5 s after a change). The learner is tested on its own (e2e_suggest.rs) and its
/// cost measured (`cargo xtask bench -- --only learn`).
const LEARN_OFF: &str = "learn = false";

/// Where [`ClusterNet::start_redis`] runs the Redis store: on the gossip bridge, in the switch
/// namespace, so that every host reaches it over its gossip link (and a host whose gossip link
/// is down cannot).
pub const REDIS_ADDR: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(198, 18, 1, 254)), 6379);

/// The first port of [`ClusterNet::start_redis_cluster`]'s nodes (one port a node, masters
/// first).
const CLUSTER_PORT: u16 = 7000;

/// The rule of [`ClusterNet::config`] and [`ClusterNet::redis_config`]: one cluster-scoped
/// limit per source of `198.18.0.0/24`.
#[must_use]
pub fn flood_rule(rate: u64, burst: u64) -> String {
    format!(
        r#"[[rule]]
name = "cluster-flood"
source = "198.18.0.0/24"
rate = {rate}
burst = {burst}
per = "source"
scope = "cluster"
"#
    )
}

/// Host `i`'s data address.
#[must_use]
pub fn data_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, 1 + u8::try_from(i).expect("at most 200 hosts"))
}

/// Host `i`'s gossip address.
#[must_use]
pub fn gossip_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, 1 + u8::try_from(i).expect("at most 200 hosts"))
}

/// Host `i`'s gossip socket address.
#[must_use]
pub fn gossip_addr(i: usize) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(gossip_ip(i)), GOSSIP_PORT)
}

/// One host: its namespace and links.
pub struct ClusterHost {
    /// The host's namespace.
    pub ns: Netns,
    /// The data link (the limiter is attached here).
    pub data_if: String,
    /// The gossip link.
    pub gossip_if: String,
}

/// The network; drop it after the agents and receivers. Its fields drop in order: the hosts, the
/// sender, the switch, then the key directory.
pub struct ClusterNet {
    /// The hosts, h0..hN-1.
    pub hosts: Vec<ClusterHost>,
    /// The sender's namespace (it owns [`FLOOD`], and what [`ClusterNet::add_source`] adds).
    pub tx: Netns,
    /// The sender's data link.
    tx_if: String,
    sw: Netns,
    /// The cluster key file (with [`SECRET`]).
    pub key_file: PathBuf,
    keys: KeyDir,
}

/// The directory of the key files, removed on drop (also when building the network failed).
struct KeyDir(PathBuf);

impl Drop for KeyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `secret` as the key file `dir/name`, mode 0600.
fn write_key(dir: &Path, name: &str, secret: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, format!("{secret}\n"))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(path)
}

/// A veth pair from `ns` to the switch `sw`, its switch end a port of `bridge`: the name of the
/// end in `ns`, and of the port.
fn plug(sw: &Netns, ns: &Netns, prefix: &str, bridge: &str) -> Result<(String, String)> {
    let (inside, port) = veth_pair(ns, sw, prefix)?;
    sw.ip(&["link", "set", &port, "master", bridge])?;
    Ok((inside, port))
}

impl ClusterNet {
    /// Builds the network for `n` hosts; namespaces are named `{tag}-sw`, `{tag}-tx`,
    /// `{tag}-hI` (plus [`Netns`]'s unique suffix).
    pub fn new(tag: &str, n: usize) -> Result<Self> {
        if n == 0 || n > MAX_HOSTS {
            bail!("{n} hosts: want 1-{MAX_HOSTS}");
        }
        let keys = KeyDir(std::env::temp_dir().join(format!("{tag}-keys-{}", std::process::id())));
        std::fs::create_dir_all(&keys.0)?;
        let key_file = write_key(&keys.0, "cluster.key", SECRET)?;
        let sw = Netns::new(&format!("{tag}-sw"))?;
        for br in ["rlbd", "rlbg"] {
            sw.ip(&["link", "add", "name", br, "type", "bridge"])?;
            sw.ip(&["link", "set", br, "up"])?;
        }
        let tx = Netns::new(&format!("{tag}-tx"))?;
        let (tx_if, _) = plug(&sw, &tx, "nt", "rlbd")?;
        add_addr(&tx, &tx_if, &format!("{FLOOD}/24"))?;
        let mut hosts = Vec::new();
        for i in 0..n {
            let ns = Netns::new(&format!("{tag}-h{i}"))?;
            let (data_if, data_port) = plug(&sw, &ns, "nd", "rlbd")?;
            let (gossip_if, _) = plug(&sw, &ns, "ng", "rlbg")?;
            add_addr(&ns, &data_if, &format!("{}/24", data_ip(i)))?;
            add_addr(&ns, &gossip_if, &format!("{}/24", gossip_ip(i)))?;
            // The hosts never send on the data link, so the bridge would never learn where their
            // MACs are and would flood every frame to every host (whose XDP would count it).
            sw.run(&[
                "bridge",
                "fdb",
                "replace",
                &mac(&ns, &data_if)?,
                "dev",
                &data_port,
                "master",
                "static",
            ])?;
            neigh_to_peer(&tx, &tx_if, IpAddr::V4(data_ip(i)), &ns, &data_if)?;
            hosts.push(ClusterHost {
                ns,
                data_if,
                gossip_if,
            });
        }
        Ok(Self {
            hosts,
            tx,
            tx_if,
            sw,
            key_file,
            keys,
        })
    }

    /// Another key file `name` in the bed's key directory holding `secret` (mode 0600; removed
    /// with the network), e.g. a key that is not the cluster's.
    pub fn write_key(&self, name: &str, secret: &str) -> Result<PathBuf> {
        write_key(&self.keys.0, name, secret)
    }

    /// A gossip-only namespace `{tag}` (plus [`Netns`]'s unique suffix) on the gossip bridge at
    /// `ip`/24 (for an attacker): the namespace and its link.
    pub fn gossip_only(&self, tag: &str, ip: Ipv4Addr) -> Result<(Netns, String)> {
        let ns = Netns::new(tag)?;
        let (inside, _) = plug(&self.sw, &ns, "nx", "rlbg")?;
        add_addr(&ns, &inside, &format!("{ip}/24"))?;
        Ok((ns, inside))
    }

    /// Static neighbours between every pair of hosts on their gossip links: nothing but gossip
    /// ever leaves a gossip link (no ARP), so its byte counter can be compared with the agent's
    /// exactly.
    pub fn pin_gossip_neighbours(&self) -> Result<()> {
        for (i, a) in self.hosts.iter().enumerate() {
            for (j, b) in self.hosts.iter().enumerate() {
                if i != j {
                    neigh_to_peer(
                        &a.ns,
                        &a.gossip_if,
                        IpAddr::V4(gossip_ip(j)),
                        &b.ns,
                        &b.gossip_if,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// A host's config: one `scope = "cluster"` rule `cluster-flood` over 198.18.0.0/24 per
    /// source, gossip on its own link seeded with every host.
    #[must_use]
    pub fn config(&self, i: usize, rate: u64, burst: u64, sync_ms: u64) -> String {
        self.config_with(i, &flood_rule(rate, burst), sync_ms)
    }

    /// A host's config with `rules` (TOML `[[rule]]` tables), the limiter on its data link and
    /// gossip on its own link seeded with every host.
    #[must_use]
    pub fn config_with(&self, i: usize, rules: &str, sync_ms: u64) -> String {
        self.config_agent_with(i, "", rules, sync_ms)
    }

    /// [`ClusterNet::config_with`] with `agent_keys` (TOML `key = value` lines, e.g.
    /// `max_buckets = 64`) added to the `[agent]` table.
    #[must_use]
    pub fn config_agent_with(
        &self,
        i: usize,
        agent_keys: &str,
        rules: &str,
        sync_ms: u64,
    ) -> String {
        let seeds: Vec<String> = (0..self.hosts.len())
            .filter(|&j| j != i)
            .map(|j| gossip_addr(j).to_string())
            .collect();
        format!(
            r#"[agent]
interfaces = ["{}"]
mode = "auto"
{LEARN_OFF}
{agent_keys}
{rules}
[cluster]
listen = "{}"
seeds = {seeds:?}
key_file = "{}"
sync_interval_ms = {sync_ms}
cluster_id = "e2e-cluster-net"
"#,
            self.hosts[i].data_if,
            gossip_addr(i),
            self.key_file.display()
        )
    }

    /// Starts an agent on every host with [`ClusterNet::config`] and waits (up to `timeout`)
    /// until each counts all the others.
    pub fn start_agents(
        &self,
        rate: u64,
        burst: u64,
        sync_ms: u64,
        timeout: Duration,
    ) -> Result<Vec<AgentProcess>> {
        self.start_agents_with(|i| self.config(i, rate, burst, sync_ms), timeout)
    }

    /// Starts an agent on every host `i` with the config `config(i)`, waiting for none of them
    /// to count the others (for a test where some cannot).
    pub fn start_agents_unwaited(
        &self,
        config: impl Fn(usize) -> String,
    ) -> Result<Vec<AgentProcess>> {
        let mut agents = Vec::new();
        for (i, h) in self.hosts.iter().enumerate() {
            agents.push(
                AgentProcess::start_logging(&h.ns, &config(i), &[], &agent_log())
                    .with_context(|| format!("agent h{i}"))?,
            );
        }
        Ok(agents)
    }

    /// Starts an agent on every host `i` with the config `config(i)` and waits (up to
    /// `timeout`) until each counts all the others.
    pub fn start_agents_with(
        &self,
        config: impl Fn(usize) -> String,
        timeout: Duration,
    ) -> Result<Vec<AgentProcess>> {
        let n = self.hosts.len();
        let agents = self.start_agents_unwaited(config)?;
        let formed = Instant::now();
        loop {
            let mut all = true;
            for a in &agents {
                all &= counted_peers(&status(a)?).len() == n - 1;
            }
            if all {
                return Ok(agents);
            }
            if formed.elapsed() > timeout {
                let views: Vec<String> = agents
                    .iter()
                    .map(|a| status(a).map_or_else(|e| e.to_string(), |s| s["cluster"].to_string()))
                    .collect();
                bail!(
                    "the cluster of {n} did not form within {timeout:?}: {views:#?}\nh0 log:\n{}",
                    agents[0].log()
                );
            }
            thread::sleep(Duration::from_millis(200));
        }
    }

    /// Starts a `redis-server` at [`REDIS_ADDR`] (on the gossip bridge, in the switch namespace),
    /// for agents on `backend = "redis"` ([`ClusterNet::redis_config_with`]).
    pub fn start_redis(&self) -> Result<crate::redis::RedisServer> {
        self.start_redis_with(&[])
    }

    /// [`ClusterNet::start_redis`] with more `redis-server` arguments (see
    /// [`RedisServer::start_with`](crate::redis::RedisServer::start_with)).
    pub fn start_redis_with(&self, args: &[&str]) -> Result<crate::redis::RedisServer> {
        self.redis_address()?;
        crate::redis::RedisServer::start_with(&self.sw, REDIS_ADDR, args)
    }

    /// Gives the switch namespace [`REDIS_ADDR`]'s address on the gossip bridge, once.
    fn redis_address(&self) -> Result<()> {
        let cidr = format!("{}/24", REDIS_ADDR.ip());
        let have = self.sw.ip(&["-4", "addr", "show", "dev", "rlbg"])?;
        if !have.contains(&format!("{} ", REDIS_ADDR.ip())) && !have.contains(&cidr) {
            add_addr(&self.sw, "rlbg", &cidr)?;
        }
        Ok(())
    }

    /// Starts a Redis Cluster of `masters` masters and as many replicas
    /// ([`RedisCluster`](crate::redis::RedisCluster)) at [`REDIS_ADDR`]'s address, ports 7000 on.
    pub fn start_redis_cluster(&self, masters: usize) -> Result<crate::redis::RedisCluster> {
        self.redis_address()?;
        crate::redis::RedisCluster::start(&self.sw, REDIS_ADDR.ip(), CLUSTER_PORT, masters)
    }

    /// The URLs of the masters [`ClusterNet::start_redis_cluster`] starts, known before it
    /// runs (a config written ahead of the store).
    #[must_use]
    pub fn redis_cluster_masters(masters: u16) -> Vec<String> {
        (0..masters)
            .map(|m| format!("redis://{}:{}", REDIS_ADDR.ip(), CLUSTER_PORT + m))
            .collect()
    }

    /// Host `i`'s config with `rules` under `backend = "redis"` with `urls` its seeds (one for a
    /// standalone Redis, a Redis Cluster's nodes), no gossip keys.
    #[must_use]
    pub fn redis_config_with<U: AsRef<str> + std::fmt::Debug>(
        &self,
        i: usize,
        rules: &str,
        sync_ms: u64,
        urls: &[U],
    ) -> String {
        format!(
            r#"[agent]
interfaces = ["{}"]
mode = "auto"
{LEARN_OFF}

{rules}
[cluster]
backend = "redis"
redis = {urls:?}
redis_connect_timeout_ms = 200
redis_command_timeout_ms = 100
sync_interval_ms = {sync_ms}
cluster_id = "e2e-cluster-net"
"#,
            self.hosts[i].data_if,
        )
    }

    /// [`ClusterNet::redis_config`] with every one of `urls` a seed (the nodes of a Redis
    /// Cluster).
    #[must_use]
    pub fn redis_cluster_config(
        &self,
        i: usize,
        rate: u64,
        burst: u64,
        sync_ms: u64,
        urls: &[String],
    ) -> String {
        self.redis_config_with(i, &flood_rule(rate, burst), sync_ms, urls)
    }

    /// [`ClusterNet::config`]'s rule under `backend = "redis"` at `url`.
    #[must_use]
    pub fn redis_config(&self, i: usize, rate: u64, burst: u64, sync_ms: u64, url: &str) -> String {
        self.redis_config_with(i, &flood_rule(rate, burst), sync_ms, &[url])
    }

    /// Takes host `i`'s gossip link down or up.
    pub fn set_gossip(&self, i: usize, up: bool) -> Result<()> {
        let h = &self.hosts[i];
        h.ns.ip(&["link", "set", &h.gossip_if, if up { "up" } else { "down" }])?;
        Ok(())
    }

    /// A receiver on every host's data address, watching its stalls (see [`stalls`]).
    pub fn receivers(&self) -> Result<Vec<Receiver>> {
        (0..self.hosts.len())
            .map(|i| {
                Receiver::bind_watching_stalls(
                    &self.hosts[i].ns,
                    SocketAddr::new(IpAddr::V4(data_ip(i)), DATA_PORT),
                )
            })
            .collect()
    }

    /// Bytes sent on host `i`'s gossip link so far.
    pub fn gossip_tx_bytes(&self, i: usize) -> Result<u64> {
        let h = &self.hosts[i];
        let out =
            h.ns.ip(&["-s", "-j", "link", "show", "dev", &h.gossip_if])?;
        let link: Value = serde_json::from_str(&out)?;
        Ok(link[0]["stats64"]["tx"]["bytes"].as_u64().unwrap_or(0))
    }

    /// Spawns the flood sender (see [`send_split`]) from [`FLOOD`] to every host's receiver.
    pub fn flood(&self, schedule: Vec<Split>, start: Instant) -> Result<thread::JoinHandle<Sent>> {
        self.flood_from(FLOOD, schedule, start)
    }

    /// Gives the sender another source address in the data subnet, for
    /// [`ClusterNet::flood_from`] (or any socket bound in [`ClusterNet::tx`]): any 198.18.0.x
    /// above the hosts' addresses (198.18.0.1 to .N) and below [`FLOOD`] (.250), so .N+1 to .249.
    pub fn add_source(&self, source: Ipv4Addr) -> Result<()> {
        let n = self.hosts.len();
        let [a, b, c, x] = source.octets();
        if [a, b, c] != [198, 18, 0] || usize::from(x) <= n || x >= FLOOD.octets()[3] {
            bail!(
                "{source}: a source is 198.18.0.{}-249 (not a host's address, 198.18.0.1-{n}, \
                 nor {FLOOD} or above)",
                n + 1
            );
        }
        add_addr(&self.tx, &self.tx_if, &format!("{source}/24"))
    }

    /// [`ClusterNet::flood`] from `source` ([`FLOOD`], or an address [`ClusterNet::add_source`]
    /// gave the sender).
    pub fn flood_from(
        &self,
        source: Ipv4Addr,
        schedule: Vec<Split>,
        start: Instant,
    ) -> Result<thread::JoinHandle<Sent>> {
        let sock = bind_udp(&self.tx, SocketAddr::new(IpAddr::V4(source), 0))?;
        let dsts: Vec<SocketAddr> = (0..self.hosts.len())
            .map(|i| SocketAddr::new(IpAddr::V4(data_ip(i)), DATA_PORT))
            .collect();
        Ok(thread::Builder::new()
            .name(format!("flood-{source}"))
            .spawn(move || send_split(&sock, &dsts, &schedule, start))?)
    }
}

impl ClusterNet {
    /// Spawns [`send_bursts`](crate::bursty::send_bursts) of `plan` from `source` ([`FLOOD`],
    /// or an address [`ClusterNet::add_source`] gave the sender) to every host's receiver.
    pub fn bursts_from(
        &self,
        source: Ipv4Addr,
        plan: crate::bursty::Plan,
        start: Instant,
    ) -> Result<thread::JoinHandle<crate::bursty::BurstLog>> {
        let sock = bind_udp(&self.tx, SocketAddr::new(IpAddr::V4(source), 0))?;
        let dsts: Vec<SocketAddr> = (0..self.hosts.len())
            .map(|i| SocketAddr::new(IpAddr::V4(data_ip(i)), DATA_PORT))
            .collect();
        Ok(thread::Builder::new()
            .name(format!("bursts-{source}"))
            .spawn(move || crate::bursty::send_bursts(&sock, &dsts, &plan, start))?)
    }

    /// An `AF_PACKET` socket on the sender's data link addressed to host `i`'s data link, for
    /// frames with any source address ([`ClusterNet::udp_frame`]).
    pub fn raw_to(&self, i: usize) -> Result<RawSocket> {
        let h = &self.hosts[i];
        RawSocket::open_in(
            &self.tx,
            ifindex(&self.tx, &self.tx_if)?,
            mac_bytes(&h.ns, &h.data_if)?,
        )
    }

    /// A UDP frame of 64 payload bytes from `source` (any address: spoofed) to host `i`'s data
    /// address and `port`, with the sender's and the host's MACs and real checksums.
    pub fn udp_frame(&self, source: Ipv4Addr, i: usize, port: u16) -> Result<Vec<u8>> {
        let h = &self.hosts[i];
        let macs = (
            mac_bytes(&self.tx, &self.tx_if)?,
            mac_bytes(&h.ns, &h.data_if)?,
        );
        Ok(udp_frame(macs, source, data_ip(i), port))
    }

    /// Sends one frame from `source` (spoofed: the sender need not own it) to host `i`'s
    /// receiver: `source` reaches that host's limiter as if it had sent there.
    pub fn spoof(&self, source: Ipv4Addr, i: usize) -> Result<()> {
        let frame = self.udp_frame(source, i, DATA_PORT)?;
        self.raw_to(i)?
            .send(&frame)
            .with_context(|| format!("sending a frame from {source} to h{i}"))
    }

    /// Spawns one thread per host that sends it `pps` frames a second for `duration`, from the
    /// `sources` (spoofed), round-robin, to `port`: a flood of many sources, each new to the
    /// host's bucket store while there are more of them than it holds. Each thread returns what
    /// [`RawSocket::send_paced`] reports.
    pub fn spoofed_flood(
        &self,
        sources: &[Ipv4Addr],
        port: u16,
        pps: u64,
        duration: Duration,
    ) -> Result<Vec<thread::JoinHandle<Result<crate::SendReport>>>> {
        let mut threads = Vec::new();
        for i in 0..self.hosts.len() {
            let h = &self.hosts[i];
            let macs = (
                mac_bytes(&self.tx, &self.tx_if)?,
                mac_bytes(&h.ns, &h.data_if)?,
            );
            let frames: Vec<Vec<u8>> = sources
                .iter()
                .map(|&s| udp_frame(macs, s, data_ip(i), port))
                .collect();
            let raw = self.raw_to(i)?;
            threads.push(
                thread::Builder::new()
                    .name(format!("spoofed-h{i}"))
                    .spawn(move || raw.send_paced(&frames, pps, duration))?,
            );
        }
        Ok(threads)
    }
}

/// A UDP frame of 64 payload bytes between `macs` (source, destination) from `source` to
/// `dst:port`, with real checksums.
fn udp_frame(macs: ([u8; 6], [u8; 6]), source: Ipv4Addr, dst: Ipv4Addr, port: u16) -> Vec<u8> {
    crate::packet::eth()
        .macs(macs.0, macs.1)
        .ipv4(source, dst)
        .udp(40_000, port)
        .payload(64)
        .checksums()
        .build()
}

/// `ratelimit --socket S status --json`, parsed.
pub fn status(agent: &AgentProcess) -> Result<Value> {
    let out = Command::new(agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .args(["status", "--json"])
        .output()
        .context("running ratelimit status")?;
    if !out.status.success() {
        bail!(
            "status failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            agent.log()
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The agents' `RUST_LOG`: `$RL_AGENT_LOG` (such as `info,ratelimit::cluster::sync=trace` for
/// each key's share every round, in [`AgentProcess::log`]), else `info`.
fn agent_log() -> String {
    std::env::var("RL_AGENT_LOG").unwrap_or_else(|_| "info".into())
}

/// Writes each agent's log to `$RL_AGENT_LOG_DIR/TAG-hN.log` when that is set (with
/// `RL_AGENT_LOG`, see [`agent_log`], to read each round's shares after a run); `true` if it did.
pub fn save_agent_logs(tag: &str, agents: &[AgentProcess]) -> bool {
    let Ok(dir) = std::env::var("RL_AGENT_LOG_DIR") else {
        return false;
    };
    for (i, a) in agents.iter().enumerate() {
        let _ = std::fs::write(format!("{dir}/{tag}-h{i}.log"), a.log());
    }
    true
}

/// The addresses of the peers `status` shows counted.
#[must_use]
pub fn counted_peers(status: &Value) -> Vec<String> {
    status["cluster"]["peers"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter(|p| p["counted"] == true)
                .map(|p| p["addr"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// A cluster counter of `status`, 0 if absent.
#[must_use]
pub fn cluster_counter(status: &Value, name: &str) -> u64 {
    status["cluster"]["counters"][name].as_u64().unwrap_or(0)
}

/// CPU time (user + system) the process `pid` used so far, from `/proc/PID/stat`.
pub fn cpu_time(pid: libc::pid_t) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces, inside parentheses).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 after the state field.
    let ticks: u64 = f.get(11).and_then(|s| s.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100);
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz.max(1)))
}

/// From `start + t_end` back to the previous split's end, `pps` packets per second in total,
/// spread over the hosts in proportion to `weights` (one per host).
#[derive(Clone, Debug)]
pub struct Split {
    /// Seconds after the start at which this split ends.
    pub end: f64,
    /// Packets per second in total.
    pub pps: f64,
    /// Relative shares, one per host.
    pub weights: Vec<f64>,
}

/// What [`send_split`] sent: the datagrams to each destination, and when it did not run as
/// paced.
#[derive(Clone, Debug, Default)]
pub struct Sent {
    /// Datagrams sent to each destination.
    pub per_host: Vec<u64>,
    /// Every time the sender did not run for longer than [`Receiver`]'s
    /// [`STALL`](crate::receiver::STALL) (it sleeps 0.5 ms a turn).
    pub stalls: Vec<Stall>,
}

/// Sends 64-byte datagrams from `sock` to `dsts` following `schedule` until its last end, from
/// one thread (the host's share of each split, paced per destination). Falls at most 16 packets
/// behind per destination (after a preemption) rather than bursting to catch up. Returns the
/// datagrams sent to each destination, and the times it did not run as paced.
#[must_use]
pub fn send_split(
    sock: &UdpSocket,
    dsts: &[SocketAddr],
    schedule: &[Split],
    start: Instant,
) -> Sent {
    let payload = [0u8; 64];
    let n = dsts.len();
    let mut sent = vec![0u64; n];
    let mut stalls = Vec::new();
    let mut due = vec![0.0f64; n];
    let mut last = start.elapsed().as_secs_f64();
    loop {
        let t = start.elapsed().as_secs_f64();
        let Some(split) = schedule.iter().find(|s| t < s.end) else {
            return Sent {
                per_host: sent,
                stalls,
            };
        };
        let total: f64 = split.weights.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let dt = t - last;
        if dt > crate::receiver::STALL.as_secs_f64() {
            stalls.push(Stall {
                who: Stalled::Sender,
                at: last,
                secs: dt,
            });
        }
        last = t;
        for i in 0..n {
            let pps = split.pps * split.weights.get(i).copied().unwrap_or(0.0) / total;
            #[expect(clippy::cast_precision_loss, reason = "small counts")]
            let cap = sent[i] as f64 + 16.0;
            due[i] = (due[i] + dt * pps).min(cap);
        }
        // Round-robin over the destinations, one datagram each, so no host's share arrives as
        // a block.
        loop {
            let mut any = false;
            for i in 0..n {
                #[expect(clippy::cast_precision_loss, reason = "small counts")]
                if (sent[i] as f64) + 1.0 <= due[i] {
                    any = true;
                    match sock.send_to(&payload, dsts[i]) {
                        Ok(_) => sent[i] += 1,
                        Err(e)
                            if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) =>
                        {
                            due[i] -= 1.0;
                        }
                        Err(e) => panic!("sending to {}: {e}", dsts[i]),
                    }
                }
            }
            if !any {
                break;
            }
        }
        thread::sleep(Duration::from_micros(500));
    }
}
