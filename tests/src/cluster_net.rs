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
    add_addr, agent_binary, bind_udp, mac, neigh_to_peer, veth_pair, AgentProcess, Netns, Receiver,
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
        let seeds: Vec<String> = (0..self.hosts.len())
            .filter(|&j| j != i)
            .map(|j| gossip_addr(j).to_string())
            .collect();
        format!(
            r#"[agent]
interfaces = ["{}"]
mode = "auto"

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
                AgentProcess::start(&h.ns, &config(i), &[])
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

    /// A receiver on every host's data address.
    pub fn receivers(&self) -> Result<Vec<Receiver>> {
        (0..self.hosts.len())
            .map(|i| {
                Receiver::bind(
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
    pub fn flood(
        &self,
        schedule: Vec<Split>,
        start: Instant,
    ) -> Result<thread::JoinHandle<Vec<u64>>> {
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
    ) -> Result<thread::JoinHandle<Vec<u64>>> {
        let sock = bind_udp(&self.tx, SocketAddr::new(IpAddr::V4(source), 0))?;
        let dsts: Vec<SocketAddr> = (0..self.hosts.len())
            .map(|i| SocketAddr::new(IpAddr::V4(data_ip(i)), DATA_PORT))
            .collect();
        Ok(thread::Builder::new()
            .name(format!("flood-{source}"))
            .spawn(move || send_split(&sock, &dsts, &schedule, start))?)
    }
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

/// Sends 64-byte datagrams from `sock` to `dsts` following `schedule` until its last end, from
/// one thread (the host's share of each split, paced per destination). Falls at most 16 packets
/// behind per destination (after a preemption) rather than bursting to catch up. Returns the
/// datagrams sent to each destination.
#[must_use]
pub fn send_split(
    sock: &UdpSocket,
    dsts: &[SocketAddr],
    schedule: &[Split],
    start: Instant,
) -> Vec<u64> {
    let payload = [0u8; 64];
    let n = dsts.len();
    let mut sent = vec![0u64; n];
    let mut due = vec![0.0f64; n];
    let mut last = start.elapsed().as_secs_f64();
    loop {
        let t = start.elapsed().as_secs_f64();
        let Some(split) = schedule.iter().find(|s| t < s.end) else {
            return sent;
        };
        let total: f64 = split.weights.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let dt = t - last;
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
        let starts: Vec<f64> = self
            .0
            .iter()
            .map(|s| s.t)
            .filter(|&t| t >= t0 && t + window <= t1)
            .collect();
        let mut from = None;
        for &u in starts.iter().rev() {
            let r = self.rate(u, u + window);
            if (r / want - 1.0).abs() <= tolerance {
                from = Some(u);
            } else {
                break;
            }
        }
        from.map(|u| u - t0)
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
