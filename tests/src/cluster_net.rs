//! A cluster of N real agents for end-to-end tests and the bench: a switch namespace with a data
//! bridge and a gossip bridge, a sender namespace, and N host namespaces, each with the limiter
//! attached to its data link and gossiping on its own link (so a partition is one
//! `ip link set down`). One paced sender thread spreads a source's flood over the hosts following
//! a schedule of splits; [`Sampler`] reads what each host delivered, and [`Samples`] turns that
//! into the cluster's admitted rate over any window.
//!
//! ```text
//!   sw namespace: bridge "rlbd" (data, 198.18.0.0/24), bridge "rlbg" (gossip, 198.18.1.0/24)
//!   tx --data-- rlbd --data-- h0 .. hN-1
//!               rlbg --gossip-- h0 .. hN-1
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::{
    add_addr, agent_binary, bind_udp, ifindex, mac, mac_bytes, neigh_to_peer, veth_pair,
    AgentProcess, Netns, RawSocket, Receiver,
};

/// The flood source every [`ClusterNet`] can send from.
pub const FLOOD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 250);
/// The gossip port of every host.
pub const GOSSIP_PORT: u16 = 7946;
/// The port the hosts' receivers listen on.
pub const DATA_PORT: u16 = 9000;
/// The cluster key's secret.
const SECRET: &str = "k8Qx2v9Lm4Tz7Rb1Nc6Yh3Wd5Gf0Ps8Ju2Ea4Ko7Ui1";
/// Most hosts (addresses 198.18.{0,1}.1..=200).
pub const MAX_HOSTS: usize = 200;

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

/// The network; drop it after the agents and receivers.
pub struct ClusterNet {
    /// The hosts, h0..hN-1.
    pub hosts: Vec<ClusterHost>,
    /// The sender's namespace (it owns [`FLOOD`]).
    pub tx: Netns,
    /// The sender's data link.
    tx_if: String,
    _sw: Netns,
    keys: PathBuf,
    /// The cluster key file.
    pub key_file: PathBuf,
}

impl Drop for ClusterNet {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.keys);
    }
}

impl ClusterNet {
    /// Builds the network for `n` hosts; namespaces are named `{tag}-sw`, `{tag}-tx`,
    /// `{tag}-hI` (plus [`Netns`]'s unique suffix).
    pub fn new(tag: &str, n: usize) -> Result<Self> {
        if n == 0 || n > MAX_HOSTS {
            bail!("{n} hosts: want 1-{MAX_HOSTS}");
        }
        let keys = std::env::temp_dir().join(format!("{tag}-keys-{}", std::process::id()));
        std::fs::create_dir_all(&keys)?;
        let key_file = keys.join("cluster.key");
        std::fs::write(&key_file, format!("{SECRET}\n"))?;
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600))?;
        let sw = Netns::new(&format!("{tag}-sw"))?;
        for br in ["rlbd", "rlbg"] {
            sw.ip(&["link", "add", "name", br, "type", "bridge"])?;
            sw.ip(&["link", "set", br, "up"])?;
        }
        let plug = |ns: &Netns, prefix: &str, bridge: &str| -> Result<(String, String)> {
            let (inside, port) = veth_pair(ns, &sw, prefix)?;
            sw.ip(&["link", "set", &port, "master", bridge])?;
            Ok((inside, port))
        };
        let tx = Netns::new(&format!("{tag}-tx"))?;
        let (tx_if, _) = plug(&tx, "nt", "rlbd")?;
        add_addr(&tx, &tx_if, &format!("{FLOOD}/24"))?;
        let mut hosts = Vec::new();
        for i in 0..n {
            let ns = Netns::new(&format!("{tag}-h{i}"))?;
            let (data_if, data_port) = plug(&ns, "nd", "rlbd")?;
            let (gossip_if, _) = plug(&ns, "ng", "rlbg")?;
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
            _sw: sw,
            keys,
            key_file,
        })
    }

    /// A host's config: one `scope = "cluster"` rule `cluster-flood` over 198.18.0.0/24 per
    /// source, gossip on its own link seeded with every host.
    #[must_use]
    pub fn config(&self, i: usize, rate: u64, burst: u64, sync_ms: u64) -> String {
        self.config_with(
            i,
            &format!(
                r#"[[rule]]
name = "cluster-flood"
source = "198.18.0.0/24"
rate = {rate}
burst = {burst}
per = "source"
scope = "cluster"
"#
            ),
            sync_ms,
        )
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

    /// Starts an agent on every host `i` with the config `config(i)` and waits (up to
    /// `timeout`) until each counts all the others.
    pub fn start_agents_with(
        &self,
        config: impl Fn(usize) -> String,
        timeout: Duration,
    ) -> Result<Vec<AgentProcess>> {
        let n = self.hosts.len();
        let mut agents = Vec::new();
        for (i, h) in self.hosts.iter().enumerate() {
            agents.push(
                AgentProcess::start_logging(&h.ns, &config(i), &[], &agent_log())
                    .with_context(|| format!("agent h{i}"))?,
            );
        }
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

    /// Gives the sender another source address in the data subnet (198.18.0.201-249: above the
    /// hosts, below [`FLOOD`]), for [`ClusterNet::flood_from`].
    pub fn add_source(&self, source: Ipv4Addr) -> Result<()> {
        if !(201..250).contains(&source.octets()[3]) || source.octets()[..3] != [198, 18, 0] {
            bail!("{source}: a source is 198.18.0.201-249");
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

/// Whose thread a [`Stall`] was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stalled {
    /// The flood sender ([`send_split`]).
    Sender,
    /// The receiving thread of host `N` (see [`Receiver::stalls`]).
    Receiver(usize),
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stalled::Sender => f.write_str("sender"),
            Stalled::Receiver(h) => write!(f, "receiver h{h}"),
        }
    }
}

/// A time one of the test's own threads did not run: the flood sender, or the receiving thread
/// of a host (see [`Receiver::stalls`]). Such a pause changes what a rate over a window measures
/// without the limiter doing anything different: see [`Stall::skews`].
#[derive(Clone, Debug, PartialEq)]
pub struct Stall {
    /// Whose.
    pub who: Stalled,
    /// When it began, seconds after the start.
    pub at: f64,
    /// How long it lasted, seconds.
    pub secs: f64,
}

impl Stall {
    /// Seconds after the start between which a sample's count is not what the limiter admitted
    /// by then at the paced load, because of this stall (and a sample in them can end a window
    /// that reads low or high for that reason alone):
    /// - a receiver's: the stall itself (what arrived in it was counted when the thread ran
    ///   again), and one sampling period after it;
    /// - the sender's: the stall, and as long again after it: a bucket refills while the flood
    ///   is paused, and the flood (at least twice the limit wherever these tests measure) spends
    ///   what refilled within that time. Admitting it is the limiter's contract (`burst + rate x
    ///   t`), and a window that holds it but not the pause reads high.
    #[must_use]
    pub fn skews(&self) -> (f64, f64) {
        let after = match self.who {
            Stalled::Sender => self.secs,
            Stalled::Receiver(_) => 0.0,
        };
        (self.at, self.at + self.secs + after + STALL_SLACK)
    }
}

/// One sampling period and a little (the tests sample every 50 ms): see [`Stall::skews`].
const STALL_SLACK: f64 = 0.06;

/// The stalls of the flood sender that sent `sent` and of every receiver in `receivers` (host
/// `i`'s is [`Stalled::Receiver`]`(i)`), seconds after `start`, in the order they began.
#[must_use]
pub fn stalls(sent: &Sent, receivers: &[Receiver], start: Instant) -> Vec<Stall> {
    let mut all = sent.stalls.clone();
    all.extend(receivers.iter().enumerate().flat_map(|(i, r)| {
        r.stalls().into_iter().map(move |(at, len)| Stall {
            who: Stalled::Receiver(i),
            at: at.saturating_duration_since(start).as_secs_f64(),
            secs: len.as_secs_f64(),
        })
    }));
    all.sort_by(|a, b| a.at.total_cmp(&b.at));
    all
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

/// What [`Samples::convergence`] found over a phase.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Convergence {
    /// Seconds after the change from which on every window is within (or excused); `None` if
    /// even the last window is neither.
    pub after: Option<f64>,
    /// Windows that start in the phase (at a sample time) and end in it.
    pub windows: usize,
    /// Of those, the ones within the tolerance.
    pub within: usize,
    /// Windows outside the tolerance but measured from a sample taken in a stall's skew: their
    /// start (seconds after the start) and their rate relative to the target.
    pub excused: Vec<(f64, f64)>,
}

/// What every host delivered from the flood source, `t` seconds after the start.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Seconds after the start.
    pub t: f64,
    /// Flood packets delivered at each host so far.
    pub counts: Vec<u64>,
}

/// Samples taken through a run.
#[derive(Clone, Debug, Default)]
pub struct Samples(pub Vec<Sample>);

impl Samples {
    /// Reads every receiver's count of [`FLOOD`] now.
    pub fn take(&mut self, receivers: &[Receiver], start: Instant) {
        self.take_of(receivers, start, &[IpAddr::V4(FLOOD)]);
    }

    /// Reads every receiver's count of the datagrams from `sources` (together) now.
    pub fn take_of(&mut self, receivers: &[Receiver], start: Instant, sources: &[IpAddr]) {
        let t = start.elapsed().as_secs_f64();
        let counts = receivers
            .iter()
            .map(|r| {
                let counts = r.counts();
                sources
                    .iter()
                    .map(|s| counts.get(s).copied().unwrap_or(0))
                    .sum()
            })
            .collect();
        self.0.push(Sample { t, counts });
    }

    /// Samples every `every` until `start + until`.
    pub fn take_until(
        &mut self,
        receivers: &[Receiver],
        start: Instant,
        until: f64,
        every: Duration,
    ) {
        loop {
            self.take(receivers, start);
            let t = start.elapsed().as_secs_f64();
            if t >= until {
                return;
            }
            thread::sleep(every.min(Duration::from_secs_f64(until - t)));
        }
    }

    fn at_or_after(&self, t: f64) -> Option<&Sample> {
        self.0.iter().find(|s| s.t >= t)
    }

    fn at_or_before(&self, t: f64) -> Option<&Sample> {
        self.0.iter().rev().find(|s| s.t <= t)
    }

    /// Packets per second the whole cluster (every host) admitted between the samples nearest
    /// inside `[t1, t2]`.
    #[must_use]
    pub fn rate(&self, t1: f64, t2: f64) -> f64 {
        let (Some(a), Some(b)) = (self.at_or_after(t1), self.at_or_before(t2)) else {
            return f64::NAN;
        };
        if b.t <= a.t {
            return f64::NAN;
        }
        let sum = |s: &Sample| s.counts.iter().sum::<u64>();
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let n = (sum(b) - sum(a)) as f64;
        n / (b.t - a.t)
    }

    /// Packets per second host `h` admitted between the samples nearest inside `[t1, t2]`.
    #[must_use]
    pub fn host_rate(&self, h: usize, t1: f64, t2: f64) -> f64 {
        let (Some(a), Some(b)) = (self.at_or_after(t1), self.at_or_before(t2)) else {
            return f64::NAN;
        };
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let n = (b.counts[h] - a.counts[h]) as f64;
        n / (b.t - a.t)
    }

    /// Packets host `h` admitted between the samples nearest inside `[t1, t2]` (0 if there are
    /// none).
    #[must_use]
    pub fn packets(&self, h: usize, t1: f64, t2: f64) -> f64 {
        let (Some(a), Some(b)) = (self.at_or_after(t1), self.at_or_before(t2)) else {
            return 0.0;
        };
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let n = b.counts[h].saturating_sub(a.counts[h]) as f64;
        n
    }

    /// Seconds after `t0` (a change) from which on every `window`-long window ending by `t1`
    /// admitted within `tolerance` of `want` (relative): the first sample time `s >= t0` such
    /// that all windows `[u, u + window]` with `u >= s` (sample times) are within. `None` if
    /// even the last window is not.
    #[must_use]
    pub fn converged_after(
        &self,
        t0: f64,
        t1: f64,
        window: f64,
        want: f64,
        tolerance: f64,
    ) -> Option<f64> {
        self.convergence(t0, t1, window, want, tolerance, &[]).after
    }

    /// [`Samples::converged_after`], where a window outside `tolerance` is excused, not counted
    /// against the convergence, if the samples it is measured between (at its start and at its
    /// end) were taken during [`Stall::skews`] of `stalls` long enough to explain it: a stall of
    /// `d` seconds moves a count by at most `d` seconds of traffic, so the window's distance from
    /// `want` beyond `tolerance` must be at most their `d`s over the window. Any other window
    /// outside still counts, wherever the stalls were; and the caller sees how many windows were
    /// within on their own.
    #[must_use]
    pub fn convergence(
        &self,
        t0: f64,
        t1: f64,
        window: f64,
        want: f64,
        tolerance: f64,
        stalls: &[Stall],
    ) -> Convergence {
        let starts: Vec<f64> = self
            .0
            .iter()
            .map(|s| s.t)
            .filter(|&t| t >= t0 && t + window <= t1)
            .collect();
        // Seconds of stall whose skew holds a sample taken at `t`.
        let stalled = |t: f64| -> f64 {
            stalls
                .iter()
                .filter(|s| {
                    let (a, b) = s.skews();
                    t >= a && t <= b
                })
                .map(|s| s.secs)
                .sum()
        };
        let mut c = Convergence {
            windows: starts.len(),
            ..Convergence::default()
        };
        let mut converged = true;
        for &u in starts.iter().rev() {
            let r = self.rate(u, u + window) / want;
            let off = (r - 1.0).abs();
            let within = off <= tolerance;
            // Outside: excused if the stalls at its samples cover the seconds of traffic it is
            // off by beyond the tolerance.
            let excused = !within
                && match (self.at_or_after(u), self.at_or_before(u + window)) {
                    (Some(a), Some(b)) => (off - tolerance) * window <= stalled(a.t) + stalled(b.t),
                    _ => false,
                };
            if within {
                c.within += 1;
            } else if excused {
                c.excused.push((u, r));
            }
            converged &= within || excused;
            if converged {
                c.after = Some(u - t0);
            }
        }
        c.excused.reverse();
        c
    }

    /// The cluster's admitted rate over `window`-long windows ending at each sample time in
    /// `[t0, t1]`, as `(t, pps)`: for charts and traces.
    #[must_use]
    pub fn trailing_rates(&self, t0: f64, t1: f64, window: f64) -> Vec<(f64, f64)> {
        self.0
            .iter()
            .filter(|s| s.t >= t0 + window && s.t <= t1)
            .map(|s| (s.t, self.rate(s.t - window, s.t)))
            .filter(|(_, r)| r.is_finite())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{Sample, Samples, Stall, Stalled};

    const EVERY: f64 = 0.05;

    /// One host admitting `admitted(t)` packets by `t` (seconds), read every 50 ms for 10 s, the
    /// count read at `t` being `read(t)` of what was admitted.
    fn samples(admitted: impl Fn(f64) -> f64, read: impl Fn(f64) -> f64) -> Samples {
        let mut s = Samples::default();
        for i in 0..=200 {
            let t = f64::from(i) * EVERY;
            #[expect(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "small"
            )]
            s.0.push(Sample {
                t,
                counts: vec![admitted(read(t)).round() as u64],
            });
        }
        s
    }

    fn steady(t: f64) -> f64 {
        1000.0 * t
    }

    fn now(t: f64) -> f64 {
        t
    }

    fn receiver(at: f64, secs: f64) -> Stall {
        Stall {
            who: Stalled::Receiver(0),
            at,
            secs,
        }
    }

    /// The receiving thread paused 115 ms from 5.0 s: what arrived meanwhile is counted at
    /// 5.115 s, so the samples read during the pause are stale.
    fn late_reader(t: f64) -> f64 {
        if t > 5.0 && t < 5.115 {
            5.0
        } else {
            t
        }
    }

    #[test]
    fn steady_windows_converge_at_once() {
        let s = samples(steady, now);
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[]);
        assert_eq!(c.after, Some(0.0));
        assert_eq!(c.within, c.windows);
        assert!(c.excused.is_empty());
        assert_eq!(s.converged_after(2.0, 10.0, 1.0, 1000.0, 0.10), Some(0.0));
    }

    /// What the failed run looked like (1 s windows 0.887-1.116 from one pause), and that the
    /// pause the receiver reports excuses exactly those windows.
    #[test]
    fn a_receiver_stall_skews_windows_and_excuses_only_them() {
        let s = samples(steady, late_reader);
        let lone = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[]);
        assert!(
            lone.after.is_some_and(|a| a > 3.0),
            "without the stall the pause reads as a late convergence: {lone:?}"
        );
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[receiver(5.0, 0.115)]);
        assert_eq!(c.after, Some(0.0), "{c:?}");
        assert!(!c.excused.is_empty());
        for &(u, r) in &c.excused {
            assert!((r - 1.0).abs() > 0.10 && (r - 1.0).abs() < 0.13, "{u}: {r}");
        }
        assert_eq!(c.within + c.excused.len(), c.windows);
    }

    /// A window that admits too much for a reason other than a stall still counts, though a
    /// stall happened elsewhere in the phase: 150 packets too many at 7.5 s.
    #[test]
    fn an_excess_away_from_the_stalls_still_fails_the_convergence() {
        let over = |t: f64| steady(t) + if t >= 7.5 { 150.0 } else { 0.0 };
        let s = samples(over, late_reader);
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[receiver(5.0, 0.115)]);
        assert!(c.after.is_some_and(|a| a > 5.0), "{c:?}");
        // The same excess inside a stall's skew is excused only there: a window whose samples
        // are both outside it is not.
        let s = samples(over, now);
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[receiver(7.45, 0.1)]);
        assert!(c.after.is_some_and(|a| a > 5.0), "{c:?}");
        // Nor does a stall too short to explain the excess excuse a window it touches: 30 ms
        // cannot account for 150 packets over a 1,000 pps budget (0.05 beyond the 10%).
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[receiver(7.47, 0.03)]);
        assert!(c.after.is_some_and(|a| a > 5.0), "{c:?}");
        assert!(c.excused.is_empty(), "{c:?}");
    }

    /// The sender paused 115 ms from 5.0 s: nothing arrived, then the refilled tokens went at
    /// once (115 packets in the next 40 ms). The limiter's contract, not a miss; the sender's
    /// stall covers the windows that read high for it.
    #[test]
    fn a_sender_stall_excuses_the_refill_spent_after_it() {
        let paused = |t: f64| {
            if t <= 5.0 {
                steady(t)
            } else if t <= 5.115 {
                steady(5.0)
            } else if t <= 5.155 {
                steady(5.0) + 115.0 * (t - 5.115) / 0.04 + 1000.0 * (t - 5.115)
            } else {
                steady(t)
            }
        };
        let s = samples(paused, now);
        let lone = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[]);
        assert!(lone.after.is_some_and(|a| a > 3.0), "{lone:?}");
        let sender = Stall {
            who: Stalled::Sender,
            at: 5.0,
            secs: 0.115,
        };
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, std::slice::from_ref(&sender));
        assert_eq!(c.after, Some(0.0), "{c:?}");
        assert_eq!(c.excused.len() + c.within, c.windows);
        // The sender's stall skews the samples for as long again after it (the refill spent),
        // a receiver's only for one sampling period after it.
        let (a, b) = sender.skews();
        assert!(
            (a - 5.0).abs() < 1e-9 && (b - (5.0 + 0.23 + 0.06)).abs() < 1e-9,
            "{a} {b}"
        );
        let (a, b) = receiver(5.0, 0.115).skews();
        assert!(
            (a - 5.0).abs() < 1e-9 && (b - (5.0 + 0.115 + 0.06)).abs() < 1e-9,
            "{a} {b}"
        );
    }
}
