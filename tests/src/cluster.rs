//! What the cluster tests read and play beside the network ([`crate::cluster_net::ClusterNet`]):
//! the agents' cluster status ([`cluster`], [`counter`], [`peers`], [`counted`]) and metrics
//! ([`scrape`], [`metric`]) through the CLI, [`wait_for`], a paced sender ([`paced`]); and
//! [`Attacker`], a peer holding the cluster key that speaks the real sealed gossip protocol
//! (chitchat over the agent's own [`SecureTransport`]) and publishes whatever it is told to, from
//! a gossip-only namespace ([`ClusterNet::gossip_only`](crate::cluster_net::ClusterNet::gossip_only)).

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    process::Command,
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use chitchat::{
    spawn_chitchat, ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig,
    ProtocolVersion,
};
use ratelimit::cluster::{
    gossip::set_self_tag,
    key::ClusterKey,
    publish::{KEY_PREFIX, SYNC_KEY},
    status::Shared,
    transport::SecureTransport,
};
use serde_json::Value;

use crate::{agent_binary, cluster_net::SECRET, AgentProcess, Netns};

/// Where the agents' metrics listen, inside each host's namespace.
pub const METRICS: &str = "127.0.0.1:9477";

/// Stops each of `agents` in turn ([`AgentProcess::stop`]: SIGTERM, exit 0, pins removed).
///
/// # Panics
/// When one does not stop so, naming it `h{i}` by its place in `agents`.
pub fn stop_agents(agents: impl IntoIterator<Item = AgentProcess>) {
    for (i, a) in agents.into_iter().enumerate() {
        a.stop().unwrap_or_else(|e| panic!("stopping h{i}: {e:#}"));
    }
}

/// Runs `ratelimit --socket S ARGS` against `agent` and returns its standard output.
///
/// # Panics
/// When the command fails.
#[must_use]
pub fn cli(agent: &AgentProcess, args: &[&str]) -> String {
    let out = Command::new(agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .args(args)
        .output()
        .expect("running ratelimit");
    assert!(
        out.status.success(),
        "ratelimit {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        agent.log()
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// `status --json`'s `cluster` object.
///
/// # Panics
/// When the command fails or prints no JSON.
#[must_use]
pub fn cluster(agent: &AgentProcess) -> Value {
    let status: Value = serde_json::from_str(&cli(agent, &["status", "--json"])).unwrap();
    status["cluster"].clone()
}

/// A cluster counter of `cluster`.
///
/// # Panics
/// When it is missing.
#[must_use]
pub fn counter(cluster: &Value, name: &str) -> u64 {
    cluster["counters"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no cluster counter {name}: {cluster}"))
}

/// The peer entries of `cluster`.
#[must_use]
pub fn peers(cluster: &Value) -> Vec<Value> {
    cluster["peers"].as_array().cloned().unwrap_or_default()
}

/// The addresses of the counted peers.
#[must_use]
pub fn counted(cluster: &Value) -> Vec<String> {
    peers(cluster)
        .iter()
        .filter(|p| p["counted"] == true)
        .map(|p| p["addr"].as_str().unwrap_or("").to_string())
        .collect()
}

/// The metrics page of the agent in `ns` (listening on [`METRICS`]), encoded after the call
/// ([`crate::metrics::fresh`]).
///
/// # Panics
/// When it cannot be read.
#[must_use]
pub fn scrape(ns: &Netns) -> String {
    crate::metrics::get(ns, METRICS.parse().unwrap()).unwrap()
}

/// The value of the metric sample `series` (name and labels as encoded).
///
/// # Panics
/// When it is missing.
#[must_use]
pub fn metric(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{body}"))
}

/// Polls `f` every 50 ms until it gives a value.
///
/// # Panics
/// When `timeout` passes first.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `payload`-byte datagrams from `sock` to `dst` following `schedule`, a list of (end in
/// seconds after `start`, packets per second), until its last end. Falls at most 16 packets
/// behind (after a preemption) rather than bursting to catch up. Returns the datagrams sent.
///
/// # Panics
/// On a send error other than a full buffer.
#[must_use]
pub fn paced(
    sock: &std::net::UdpSocket,
    dst: SocketAddr,
    schedule: &[(f64, u64)],
    start: Instant,
    payload: usize,
) -> u64 {
    let payload = vec![0u8; payload];
    let (mut sent, mut due, mut last) = (0u64, 0.0f64, start.elapsed().as_secs_f64());
    loop {
        let t = start.elapsed().as_secs_f64();
        let Some(&(_, pps)) = schedule.iter().find(|(end, _)| t < *end) else {
            return sent;
        };
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let (pps, sent_f) = (pps as f64, sent as f64);
        due = (due + (t - last) * pps).min(sent_f + 16.0);
        last = t;
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        while (sent as f64) < due {
            match sock.send_to(&payload, dst) {
                Ok(_) => sent += 1,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) => {
                    due -= 1.0;
                }
                Err(e) => panic!("sending to {dst}: {e}"),
            }
        }
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let wait = if pps > 0.0 {
            ((sent as f64 + 1.0 - due) / pps).clamp(0.0, 0.005)
        } else {
            0.005
        };
        thread::sleep(Duration::from_secs_f64(wait));
    }
}

/// Wall-clock Unix milliseconds.
#[must_use]
pub fn unix_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// One identity the attacker gossips as: a chitchat server of its own (its own socket, at
/// `bind`), named `id` (whose advertised address may be anything: the attacker's, another
/// host's, one nobody uses).
#[derive(Clone, Debug)]
pub struct Identity {
    /// The chitchat id it claims.
    pub id: ChitchatId,
    /// Where its socket is bound (an address of the attacker's namespace): where its
    /// datagrams come from and are sealed from.
    pub bind: SocketAddr,
}

/// What every identity of the attacker publishes, changed by the test while it runs.
#[derive(Clone, Debug, Default)]
pub struct Claims {
    /// Consumption keys (`(rule, source)`) with the packets claimed so far (cumulative, epoch
    /// 1); bytes are claimed at 64 per packet.
    pub keys: Vec<((String, IpAddr), u64)>,
    /// Packets added to every key's count each round (100 ms) while set.
    pub per_round: u64,
    /// Junk keys published on top (`c/{rule}/203.0.x.y`, after the real sources in key order).
    pub junk: usize,
    /// Set to N: the next round publishes, once, a sync key dated 10^12 ms ahead with the largest
    /// next epoch and every key of [`Claims::keys`] at the largest epoch and demand
    /// (`u64::MAX:0:0:u64::MAX`), and the N - 1 rounds after it publish nothing (so every peer
    /// reads that one reading); the rounds after them publish as before.
    pub forge_future: u32,
}

/// A key-holding peer speaking the real protocol: one chitchat server per [`Identity`], each over
/// the agent's own sealing transport, in the attacker's namespace; every 100 ms each publishes a
/// sync key (as the agents do) and the [`Claims`].
pub struct Attacker {
    claims: Arc<Mutex<Claims>>,
    stop: Arc<Mutex<bool>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Attacker {
    /// Starts the identities in `ns`, gossiping with `seeds`, for `cluster_id`.
    ///
    /// # Panics
    /// When a server cannot start.
    #[must_use]
    pub fn start(ns: &Netns, cluster_id: &str, seeds: &[SocketAddr], ids: Vec<Identity>) -> Self {
        let claims = Arc::new(Mutex::new(Claims::default()));
        let stop = Arc::new(Mutex::new(false));
        let (c, s) = (claims.clone(), stop.clone());
        let (cluster_id, seeds) = (cluster_id.to_string(), seeds.to_vec());
        let path = ns.path();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = thread::spawn(move || {
            // Every socket the servers open is made on this thread (and the runtime's), in the
            // attacker's namespace.
            let file = std::fs::File::open(&path).unwrap();
            // SAFETY: plain syscall on a valid, open fd; it changes only this thread's namespace.
            let rc =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(run(cluster_id, seeds, ids, c, s, ready_tx));
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the attacker's servers started");
        Self {
            claims,
            stop,
            thread: Some(thread),
        }
    }

    /// Changes what is claimed.
    pub fn claims(&self, f: impl FnOnce(&mut Claims)) {
        f(&mut self.claims.lock().unwrap());
    }

    /// Stops every server (its datagrams stop at once).
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        *self.stop.lock().unwrap() = true;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The attacker's chitchat servers started, then one loop publishing its claims every 100 ms
/// until told to stop.
async fn run(
    cluster_id: String,
    seeds: Vec<SocketAddr>,
    ids: Vec<Identity>,
    claims: Arc<Mutex<Claims>>,
    stop: Arc<Mutex<bool>>,
    ready: std::sync::mpsc::Sender<()>,
) {
    let mut handles: Vec<ChitchatHandle> = Vec::new();
    for ident in &ids {
        handles.push(serve(&cluster_id, &seeds, ident).await);
    }
    let _ = ready.send(());
    let mut seq = 0u64;
    // Holding a forged reading (see [`Claims::forge_future`]).
    let mut forging = false;
    let mut published: HashSet<String> = HashSet::new();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if *stop.lock().unwrap() {
            break;
        }
        let Some((sync_value, kvs)) = next_round(&claims, &mut seq, &mut forging) else {
            continue;
        };
        for h in &handles {
            let kvs = kvs.clone();
            let fresh: HashSet<String> = kvs.iter().map(|(k, _)| k.clone()).collect();
            let gone: Vec<String> = published.difference(&fresh).cloned().collect();
            let sync_value = sync_value.clone();
            h.with_chitchat(move |c| {
                let node = c.self_node_state();
                for (k, v) in &kvs {
                    node.set(k, v);
                }
                for k in &gone {
                    node.delete(k);
                }
                node.set(SYNC_KEY, &sync_value);
            })
            .await;
        }
        published = kvs.into_iter().map(|(k, _)| k).collect();
    }
    for h in handles {
        let _ = h.shutdown().await;
    }
}

/// A chitchat server of identity `ident`, sealed as the identity it claims, from the address it
/// sends from: what the agent's own gossip does.
async fn serve(cluster_id: &str, seeds: &[SocketAddr], ident: &Identity) -> ChitchatHandle {
    let interval = Duration::from_millis(100);
    let config = ChitchatConfig {
        chitchat_id: ident.id.clone(),
        cluster_id: cluster_id.to_owned(),
        gossip_interval: interval,
        listen_addr: ident.bind,
        seed_nodes: seeds.iter().map(ToString::to_string).collect(),
        failure_detector_config: FailureDetectorConfig {
            initial_interval: interval,
            ..FailureDetectorConfig::default()
        },
        marked_for_deletion_grace_period: Duration::from_secs(60),
        catchup_callback: None,
        extra_liveness_predicate: None,
        protocol_version: ProtocolVersion::V1,
    };
    let shared = Arc::new(Shared::default());
    set_self_tag(&shared, &ident.id);
    let transport = SecureTransport::new(
        ClusterKey::from_secret(format!("{SECRET}\n").as_bytes(), cluster_id).unwrap(),
        cluster_id.to_owned(),
        shared,
    )
    .with_advertise(ident.bind);
    spawn_chitchat(config, Vec::new(), &transport)
        .await
        .expect("an attacker's chitchat server")
}

/// This round's sync value and keys, with the claims' counts advanced by a round; `None` for a
/// round that publishes nothing (after a forged reading, see [`Claims::forge_future`]).
fn next_round(
    claims: &Mutex<Claims>,
    seq: &mut u64,
    forging: &mut bool,
) -> Option<(String, Vec<(String, String)>)> {
    let mut c = claims.lock().unwrap();
    let forge = c.forge_future > 0 && !*forging;
    if c.forge_future > 0 {
        c.forge_future -= 1;
        *forging = c.forge_future > 0;
        if !forge {
            return None;
        }
    } else {
        *forging = false;
    }
    *seq += 1;
    let sync_value = if forge {
        format!("{seq}:{}:{}", unix_ms() + 1_000_000_000_000, u64::MAX)
    } else {
        format!("{seq}:{}:1", unix_ms())
    };
    let per_round = c.per_round;
    for (_, n) in &mut c.keys {
        *n += per_round;
    }
    let mut kvs: Vec<(String, String)> = c
        .keys
        .iter()
        .map(|((rule, addr), n)| {
            let value = if forge {
                format!("{}:0:0:{}", u64::MAX, u64::MAX)
            } else {
                format!("1:{n}:{}", n * 64)
            };
            (format!("{KEY_PREFIX}{rule}/{addr}"), value)
        })
        .collect();
    let rule = c
        .keys
        .first()
        .map_or("r", |((r, _), _)| r.as_str())
        .to_string();
    kvs.extend((0..c.junk).map(|i| {
        (
            format!("{KEY_PREFIX}{rule}/203.0.{}.{}", i / 256, i % 256),
            "1:1:64".to_string(),
        )
    }));
    Some((sync_value, kvs))
}
